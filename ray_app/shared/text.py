"""Text to tokens: ``data.name: text``, packed sequences for ``task.name: causal_lm``.

``data.args``:

- ``files``: a ``.txt`` or ``.jsonl`` file, a folder or ``s3://`` prefix (every ``.txt`` / ``.jsonl`` under it,
  in name order), or a list of them. A ``.txt`` file is one document. A ``.jsonl`` line is one document:
  ``{"text": ...}``, or ``{"prompt": ..., "completion": ...}`` whose prompt tokens are no target
  (label ``-100``).
- ``tokenizer``: a folder or ``s3://`` prefix with ``tokenizer.json`` (and ``tokenizer_config.json``, which
  names the ``eos_token``), as ``save_pretrained`` or ``tokenizers`` write them.
- ``seq_len``: tokens per sequence (default 512). ``eval_fraction``: the share of sequences held out for
  evaluation, the last ones (default 0.05; at least one).
- ``eos_token``: the token between documents, when ``tokenizer_config.json`` does not name one.

Packing: every document's tokens, then EOS, one document after another, cut into sequences of ``seq_len``.
Each sample is a dict of ``input_ids``, ``labels`` (``input_ids`` with the prompts' tokens set to ``-100``)
and ``attention_mask`` (1; 0 for the padding that fills the last sequence, whose labels are ``-100``):
transformers' names, so ``causal_lm`` and any Hugging Face model take them as they are. ``ray-app data write``
packs the same samples into shards, so streaming from S3 and exact (also elastic) resume come with it.

Bad input is one line naming the key: no file, an empty set, a jsonl line without the field (file and line
number), a tokenizer folder without ``tokenizer.json`` or an EOS token. ``tokenizers`` is imported only here.
"""

from __future__ import annotations

import json
import math

from ray_app.shared.errors import ConfigError

SUFFIXES = (".txt", ".jsonl")
IGNORE = -100


def _storage(uri: str, retry_s: float):
    from ray_app.shared.storage import open_storage

    return open_storage(uri.rstrip("/"), retry_s=retry_s)


def _read(uri: str, retry_s: float) -> bytes:
    parent, _, name = uri.rstrip("/").rpartition("/")
    return _storage(parent or ".", retry_s).read_bytes(name)


def text_files(files, retry_s: float = 60.0) -> list[str]:
    """Every text file ``files`` names: files as they are, folders and prefixes expanded (in name order)."""
    found: list[str] = []
    for item in [files] if isinstance(files, str) else list(files or []):
        if item.endswith(SUFFIXES):
            found.append(item)
            continue
        listing = _storage(item, retry_s).list_files("")
        found += [f"{item.rstrip('/')}/{rel}" for rel in sorted(listing) if rel.endswith(SUFFIXES)]
    if not found:
        raise ConfigError(f"config key data.args.files: no .txt or .jsonl file in {files!r}; name text files, "
                          "or a folder or s3:// prefix holding them")
    return found


def documents(uri: str, raw: bytes) -> list[tuple[str, str]]:
    """A file's documents as ``(prompt, text)`` pairs: the prompt is '' for plain text."""
    text = raw.decode("utf-8")
    if not uri.endswith(".jsonl"):
        return [("", text)] if text.strip() else []
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"config key data.args.files: {uri} line {number} is not JSON ({exc})") from None
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            out.append(("", record["text"]))
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str) \
                and isinstance(record.get("completion"), str):
            out.append((record["prompt"], record["completion"]))
        else:
            raise ConfigError(f"config key data.args.files: {uri} line {number} has neither a \"text\" string nor "
                              "\"prompt\" and \"completion\" strings")
    return out


def load_tokenizer(uri: str, eos_token: str | None = None, retry_s: float = 60.0):
    """``(tokenizer, eos_id)`` from a folder or prefix holding ``tokenizer.json``."""
    from tokenizers import Tokenizer

    storage = _storage(uri, retry_s)
    files = storage.list_files("")
    if "tokenizer.json" not in files:
        raise ConfigError(f"config key data.args.tokenizer: {uri} has no tokenizer.json; save the tokenizer there "
                          "(tokenizer.save_pretrained or Tokenizer.save)")
    tokenizer = Tokenizer.from_str(storage.read_bytes("tokenizer.json").decode("utf-8"))
    if eos_token is None and "tokenizer_config.json" in files:
        eos = json.loads(storage.read_bytes("tokenizer_config.json")).get("eos_token")
        eos_token = eos.get("content") if isinstance(eos, dict) else eos
    eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
    if eos_id is None:
        raise ConfigError(f"config key data.args.eos_token: the tokenizer in {uri} has no end-of-sequence token "
                          f"{'named ' + repr(eos_token) if eos_token else '(tokenizer_config.json names none)'}; "
                          "set data.args.eos_token to one of its tokens")
    return tokenizer, eos_id


def pack(docs: list[tuple[list[int], list[int]]], eos_id: int, seq_len: int):
    """``(input_ids, labels, attention_mask)`` int64 tensors [N, seq_len] of the documents' tokens (each
    ``(prompt_ids, text_ids)``) one after another with EOS after each; the last sequence padded."""
    import torch

    ids: list[int] = []
    labels: list[int] = []
    for prompt, text in docs:
        ids += prompt + text + [eos_id]
        labels += [IGNORE] * len(prompt) + text + [eos_id]
    n = math.ceil(len(ids) / seq_len)
    pad = n * seq_len - len(ids)
    mask = [1] * len(ids) + [0] * pad
    ids += [eos_id] * pad
    labels += [IGNORE] * pad
    shape = (n, seq_len)
    return (torch.tensor(ids).view(shape), torch.tensor(labels).view(shape), torch.tensor(mask).view(shape))


class PackedText:
    """A map-style data set of packed sequences: dicts of ``input_ids``, ``labels``, ``attention_mask``."""

    def __init__(self, input_ids, labels, attention_mask):
        self.input_ids, self.labels, self.attention_mask = input_ids, labels, attention_mask

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i], "attention_mask": self.attention_mask[i]}


def text(files, tokenizer: str, seq_len: int = 512, eval_fraction: float = 0.05, eos_token: str | None = None):
    """``data.name: text``: ``(train, eval, info)`` of packed sequences; ``info`` holds ``vocab_size``."""
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError(f"config key data.args.seq_len: {seq_len!r}; it must be an int >= 2")
    if not 0 < eval_fraction < 1:
        raise ConfigError(f"config key data.args.eval_fraction: {eval_fraction!r}; it must be between 0 and 1")
    tok, eos_id = load_tokenizer(tokenizer, eos_token)
    docs = []
    for uri in text_files(files):
        for prompt, body in documents(uri, _read(uri, 60.0)):
            docs.append((tok.encode(prompt, add_special_tokens=False).ids if prompt else [],
                         tok.encode(body, add_special_tokens=False).ids))
    if not any(body for _, body in docs):
        raise ConfigError(f"config key data.args.files: the text in {files!r} holds no token; the set is empty")
    ids, labels, mask = pack(docs, eos_id, seq_len)
    if len(ids) < 2:
        raise ConfigError(f"config key data.args.seq_len: the text makes {len(ids)} sequence of {seq_len} tokens; "
                          "at least 2 are needed (one to train, one to evaluate): lower seq_len or add text")
    n_eval = max(1, round(len(ids) * eval_fraction))
    cut = len(ids) - n_eval
    return (PackedText(ids[:cut], labels[:cut], mask[:cut]), PackedText(ids[cut:], labels[cut:], mask[cut:]),
            {"vocab_size": tok.get_vocab_size(), "seq_len": seq_len})


def check_text(data_args: dict, model_config: dict | None = None, retry_s: float = 60.0) -> None:
    """What the driver checks before Ray starts: the files and the tokenizer exist; with a Hugging Face
    model's config, its embeddings hold the tokenizer's vocabulary and its positions ``seq_len``."""
    text_files(data_args.get("files"), retry_s)
    if not data_args.get("tokenizer"):
        raise ConfigError("config key data.args.tokenizer: data.name text needs the folder or s3:// prefix of a "
                          "tokenizer.json")
    tok, _ = load_tokenizer(data_args["tokenizer"], data_args.get("eos_token"), retry_s)
    if model_config is None:
        return
    vocab, embeddings = tok.get_vocab_size(), model_config.get("vocab_size")
    if isinstance(embeddings, int) and vocab > embeddings:
        raise ConfigError(f"config key data.args.tokenizer: its vocabulary has {vocab} tokens and the model's "
                          f"embeddings {embeddings} (vocab_size in config.json); use the model's own tokenizer")
    seq_len, positions = data_args.get("seq_len", 512), model_config.get("max_position_embeddings")
    if isinstance(positions, int) and isinstance(seq_len, int) and seq_len > positions:
        raise ConfigError(f"config key data.args.seq_len: {seq_len} is more than the model's "
                          f"max_position_embeddings ({positions}); set data.args.seq_len <= {positions}")
