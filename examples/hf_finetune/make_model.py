"""Make what a fine-tune starts from, offline (no hub): a small Llama-architecture model with random weights
(``model/``, as ``save_pretrained`` writes it, safetensors in two shards), a byte-level BPE tokenizer trained on
CPython's own help text (``tokenizer/``) and that text as the corpus (``text/``, a ``.txt`` of prose and a
``.jsonl`` of prompt / completion pairs).

    python make_model.py            # then: ray-app train --config full.yaml
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 512
EOS = "<|endoftext|>"


def help_text() -> dict[str, str]:
    from pydoc_data.topics import topics  # ships with CPython: no download

    return topics


def make_tokenizer(folder: Path, text: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainer=trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256}, indent=1))


def make_model(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="2MB")


def main() -> None:
    topics = help_text()
    names = sorted(topics)
    prose = "\n\n".join(topics[k] for k in names)
    make_tokenizer(HERE / "tokenizer", prose)
    make_model(HERE / "model")
    text = HERE / "text"
    text.mkdir(exist_ok=True)
    (text / "help.txt").write_text("\n\n".join(topics[k] for k in names[:40]))
    with open(text / "topics.jsonl", "w") as f:  # prompt: the topic's name; completion: its first paragraph
        for k in names[40:]:
            f.write(json.dumps({"prompt": f"Python help on {k}:\n", "completion": topics[k].split("\n\n")[0]}) + "\n")
    print(f"wrote {HERE / 'model'}, {HERE / 'tokenizer'}, {text}")


if __name__ == "__main__":
    main()
