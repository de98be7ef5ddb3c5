"""Character-level text blocks from the help topics that ship with CPython.

`pydoc_data.topics.topics` is in every Python install (about 465,000
characters), so this example needs no download. The text changes a little
between Python releases (464,970 characters in 3.11.7, 466,019 in 3.11.2),
so all workers must run the same release (they do in one image).
"""

from pydoc_data.topics import topics

import torch
from torch.utils.data import Dataset


def load_text() -> str:
    # Sorted keys: dict order is the file's order, which can change between
    # Python releases; sorting keeps the text (and the vocabulary) fixed.
    return "".join(topics[k] for k in sorted(topics))


class CharBlocks(Dataset):
    """Blocks of `block_size` token ids starting every `stride` characters.

    Item i is `(inputs, targets)`, two LongTensor[block_size], targets being
    inputs shifted by one character.
    """

    def __init__(self, ids: torch.Tensor, block_size: int, stride: int):
        self.ids = ids
        self.block_size = block_size
        self.stride = stride
        # Each block needs block_size + 1 ids (the last target).
        self.n = max(0, (len(ids) - block_size - 1) // stride + 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = i * self.stride
        chunk = self.ids[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def build(block_size: int = 64, eval_fraction: float = 0.09, max_chars: int = 0, stride: int = 0):
    """Return `(train, eval, info)`.

    The last `eval_fraction` of the text is the eval set (split by position,
    no randomness). `max_chars` > 0 keeps only the first `max_chars`
    characters of the training part (shorter epochs); the eval part is
    always the same. `stride` (default `block_size`: non-overlapping) sets
    where training blocks start; eval blocks never overlap.
    """
    text = load_text()
    # The vocabulary comes from the whole text, so every character of the
    # eval part has an id and the vocabulary does not depend on the args.
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)

    split = int(len(ids) * (1 - eval_fraction))
    train_ids, eval_ids = ids[:split], ids[split:]
    if max_chars > 0:
        train_ids = train_ids[:max_chars]
    train = CharBlocks(train_ids, block_size, stride or block_size)
    eval_ = CharBlocks(eval_ids, block_size, block_size)
    return train, eval_, {"vocab_size": len(vocab), "block_size": block_size}
