"""Hugging Face models and tokenizers made here, offline (no hub): a tiny Llama-architecture model with random
weights and a byte-level BPE tokenizer trained on the help text that ships with CPython."""

from __future__ import annotations

import json
from pathlib import Path


def python_help_text(chars: int = 60_000) -> str:
    """CPython's own help topics (``pydoc_data.topics``), about 465,000 characters on 3.11."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:chars]


def train_tokenizer(folder: Path, vocab_size: int = 300, text: str | None = None) -> Path:
    """``tokenizer.json`` and ``tokenizer_config.json`` (eos ``<|endoftext|>``) under ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text or python_help_text()], trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def tiny_llama(folder: Path, vocab_size: int = 300, shard: str | None = None, tied: bool = True, layers: int = 2,
               hidden: int = 32, positions: int = 64) -> Path:
    """A Llama-architecture model with random weights (seed 0), saved as save_pretrained saves it."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=positions, tie_word_embeddings=tied)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder
