"""``data.name: text``: .txt and .jsonl files and a tokenizer folder packed into sequences for ``causal_lm``,
the bad inputs as one line each, and ``ray-app data write`` storing the sequences as shards bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from ray_app.shared.errors import ConfigError
from ray_app.shared.text import IGNORE, check_text, text
from tests.support.hf import python_help_text, train_tokenizer

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def test_documents_are_packed_with_eos_between_and_prompts_are_no_target(tmp_path, tokenizer):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    (tmp_path / "a.txt").write_text("def f(x): return x")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "import os"}) + "\n\n"
                                      + json.dumps({"prompt": "Q: 2+2?", "completion": " A: 4"}) + "\n")
    train, evaluation, info = text(str(tmp_path), str(tokenizer), seq_len=8, eval_fraction=0.2)
    ids = torch.cat([train.input_ids, evaluation.input_ids]).flatten()
    labels = torch.cat([train.labels, evaluation.labels]).flatten()
    mask = torch.cat([train.attention_mask, evaluation.attention_mask]).flatten()
    a, b = tok.encode("def f(x): return x").ids, tok.encode("import os").ids
    prompt, completion = tok.encode("Q: 2+2?").ids, tok.encode(" A: 4").ids
    want = a + [eos] + b + [eos] + prompt + completion + [eos]
    n = len(want)
    assert ids[:n].tolist() == want and mask[:n].all() and not mask[n:].any()  # the last sequence padded
    assert labels[:n].tolist() == a + [eos] + b + [eos] + [IGNORE] * len(prompt) + completion + [eos]
    assert (labels[n:] == IGNORE).all()
    assert info["vocab_size"] == tok.get_vocab_size() and len(evaluation) == max(1, round((len(train) + len(evaluation)) * 0.2))
    sample = train[0]
    assert set(sample) == {"input_ids", "labels", "attention_mask"} and sample["input_ids"].shape == (8,)


def test_each_bad_input_is_one_line_naming_the_key(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match=r"data.args.files: no .txt or .jsonl file in"):
        text(str(tmp_path), str(tokenizer))
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"data.args.files: .*bad.jsonl line 2 has neither a \"text\" string"):
        text(str(tmp_path / "bad.jsonl"), str(tokenizer))
    (tmp_path / "empty.txt").write_text("   \n")
    with pytest.raises(ConfigError, match=r"data.args.files: the text in .* holds no token; the set is empty"):
        text(str(tmp_path / "empty.txt"), str(tokenizer))
    with pytest.raises(ConfigError, match=r"data.args.tokenizer: .* has no tokenizer.json"):
        text(str(tmp_path / "bad.jsonl"), str(tmp_path))
    (tmp_path / "some.txt").write_text(python_help_text(2000))
    big = {"vocab_size": 50, "max_position_embeddings": 1024}
    with pytest.raises(ConfigError, match=r"data.args.tokenizer: its vocabulary has 300 tokens and the model's "
                                          r"embeddings 50"):
        check_text({"files": str(tmp_path / "some.txt"), "tokenizer": str(tokenizer)}, big)
    with pytest.raises(ConfigError, match=r"data.args.seq_len: 128 is more than the model's max_position_embeddings "
                                          r"\(64\)"):
        check_text({"files": str(tmp_path / "some.txt"), "tokenizer": str(tokenizer), "seq_len": 128},
                   {"vocab_size": 300, "max_position_embeddings": 64})


def test_data_write_packs_the_sequences_into_shards_bit_for_bit(tmp_path, tokenizer, run_cli):
    (tmp_path / "corpus.txt").write_text(python_help_text(20_000))
    dest = tmp_path / "shards"
    args = ["data", "write", str(dest), "--set", "data.name=text", "--set", f"data.args.files={tmp_path / 'corpus.txt'}",
            "--set", f"data.args.tokenizer={tokenizer}", "--set", "data.args.seq_len=64"]
    rc, out, err = run_cli(args, timeout=120)
    assert rc == 0, err
    from ray_app.shared.shards import shard_data

    train, evaluation, _ = text(str(tmp_path / "corpus.txt"), str(tokenizer), seq_len=64)
    streamed, _, info = shard_data(str(dest))
    assert len(streamed) == len(train) > 10
    for i in (0, len(train) // 2, len(train) - 1):
        got, want = streamed[i], train[i]
        assert all(torch.equal(got[k], want[k]) for k in want), i
    assert info["vocab_size"] == 300
