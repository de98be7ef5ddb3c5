"""Case (l)'s language model and text, made offline (no hub) under ``build/bench/lm-<size>/``.

- ``model/``: a Llama-architecture model with random weights (seed 0) made with transformers' ``LlamaConfig`` and
  written by ``save_pretrained`` (``tests.support.hf.tiny_llama``), its vocabulary the tokenizer's;
- ``tokenizer/``: a byte-level BPE tokenizer trained on CPython's own help text (``pydoc_data.topics``);
- ``text/help.txt``: that text, the corpus ``data.name: text`` packs into sequences of ``seq_len`` tokens.

The kit reads them as ``model.name: hf`` + ``data.name: text`` + ``task.name: causal_lm``; the twin
(``bench/twin.py``) loads the same folder with ``from_pretrained`` and the same text with the kit's packing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    # 4 layers, hidden 128, vocab 2048: 1.1M parameters, an embedding and output head as big as the layers;
    # the whole help text (about 465,000 characters) at 128 tokens a sequence
    "full": {"layers": 4, "hidden": 128, "vocab": 2048, "positions": 256, "chars": 1_000_000, "seq_len": 128},
    "smoke": {"layers": 2, "hidden": 32, "vocab": 300, "positions": 64, "chars": 30_000, "seq_len": 32},
}


def folder(size: str) -> Path:
    return REPO / "build" / "bench" / f"lm-{size}"


def overrides(size: str) -> tuple[str, ...]:
    """The --set values naming the folder's model, tokenizer and text (the same for the kit and the twin)."""
    d, s = folder(size), SIZES[size]
    return ("model.name=hf", f"model.args.path={d / 'model'}", "task.name=causal_lm", "data.name=text",
            f"data.args.files={d / 'text' / 'help.txt'}", f"data.args.tokenizer={d / 'tokenizer'}",
            f"data.args.seq_len={s['seq_len']}")


def target_tokens_per_sample(size: str) -> int:
    """Every training sequence is full (the padding fills only the text's last sequence, which is held out for
    evaluation): ``seq_len - 1`` target tokens each, the first token being no target (the task shifts by one)."""
    return SIZES[size]["seq_len"] - 1


def make(size: str) -> Path:
    """Write the folder afresh (the same bytes each time: seeded, deterministic training of the tokenizer)."""
    from tests.support.hf import python_help_text, tiny_llama, train_tokenizer

    d, s = folder(size), SIZES[size]
    shutil.rmtree(d, ignore_errors=True)
    text = python_help_text(s["chars"])
    train_tokenizer(d / "tokenizer", vocab_size=s["vocab"], text=text)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(d / "tokenizer" / "tokenizer.json")).get_vocab_size()
    tiny_llama(d / "model", vocab_size=vocab, tied=False, layers=s["layers"], hidden=s["hidden"],
               positions=s["positions"])
    (d / "text").mkdir()
    (d / "text" / "help.txt").write_text(text)
    return d
