"""Small language models and their data as plug-ins, for the speed switches' tests: the char_lm example's GPT
(examples/char_lm) and a tiny Llama-architecture model (transformers, random weights), both on character blocks
of CPython's help text (the char_lm example's data)."""

from __future__ import annotations

import sys
from pathlib import Path

from torch import nn
from torch.utils.data import Dataset

from tests.support.unsharded_model import BlockClassifier

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "char_lm"


def _char_lm():
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import char_lm.data
    import char_lm.model

    return char_lm


def gpt(vocab_size: int, block_size: int, **kwargs):
    """The char_lm example's GPT (a ModuleList of ``Block``s; its embedding tied to its head)."""
    return _char_lm().model.GPT(vocab_size, block_size, **kwargs)


def char_pairs(block_size: int = 32, max_chars: int = 40_000, eval_fraction: float = 0.005):
    """The char_lm example's data: (inputs, targets) blocks, for ``task.name=language_model``."""
    return _char_lm().data.build(block_size=block_size, eval_fraction=eval_fraction, max_chars=max_chars)


class _Inputs(Dataset):
    """A pair data set's inputs alone: a causal LM's ``input_ids`` (transformers' convention: the labels are the
    ids, the task shifts)."""

    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i][0]


def char_ids(block_size: int = 32, max_chars: int = 40_000, eval_fraction: float = 0.005):
    """The same blocks as token ids alone, for ``task.name=causal_lm``."""
    train, eval_, info = char_pairs(block_size, max_chars, eval_fraction)
    return _Inputs(train), _Inputs(eval_), {"vocab_size": info["vocab_size"]}


def llama(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4):
    """``transformers.LlamaForCausalLM`` with random weights (the run's seed): its decoder layers are a
    ModuleList (``model.layers``)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


class _Branchy(nn.Module):
    """A block whose path depends on its input's values: data-dependent control flow, which torch.compile
    cannot capture in one graph."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        if x.sum() > 0:
            return x + self.fc(x)
        return x - self.fc(x)


class BranchyNet(BlockClassifier):
    """A classifier whose blocks torch.compile cannot compile whole (``_Branchy``)."""

    def __init__(self, channels: int, image_size: int, num_classes: int, width: int = 16):
        super().__init__(channels, image_size, num_classes, _Branchy, 2, width)
