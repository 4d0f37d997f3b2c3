"""The offline-trained BPE tokenizer (real merges, Qwen2 class, ChatML) and the synthetic GSM8K rows it learns from."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hybridrl.data.answers import gsm8k_answer
from hybridrl.data.synthetic_gsm8k import gsm8k_like_rows
from hybridrl.models.bpe_tokenizer import train_bpe_tokenizer
from hybridrl.models.char_tokenizer import EOS_TOKEN, PAD_TOKEN


def test_synthetic_rows_are_gsm8k_shaped_correct_and_deterministic() -> None:
    rows = gsm8k_like_rows(200, seed=3)
    assert rows == gsm8k_like_rows(200, seed=3) and rows != gsm8k_like_rows(200, seed=4)
    for row in rows:
        assert set(row) == {"question", "answer"} and row["question"].endswith("?")
        answer = gsm8k_answer(row["answer"])
        assert answer is not None and answer.isdigit()
        # the last calculator annotation computes the final answer
        last = row["answer"].rsplit("<<", 1)[1].split(">>")[0]
        expression, result = last.split("=")
        assert eval(expression) == int(result) == int(answer)  # noqa: S307 (our own arithmetic)
    assert any("#### 1," in r["answer"] or "#### 2," in r["answer"] for r in gsm8k_like_rows(2000))  # thousands


def test_bpe_tokenizer_learns_merges_round_trips_and_reloads(tmp_path: Path) -> None:
    rows = gsm8k_like_rows(500)
    tok = train_bpe_tokenizer((r["question"] + "\n" + r["answer"] for r in rows), vocab_size=400,
                              model_max_length=256)
    text = rows[0]["question"] + "\n" + rows[0]["answer"]
    ids = tok(text)["input_ids"]
    assert len(ids) < 0.6 * len(text)  # merges: well under one token per char
    assert tok.decode(ids) == text
    assert tok.decode(tok("naïve café — 100% ✓")["input_ids"]) == "naïve café — 100% ✓"  # any text: byte alphabet
    assert len(tok) <= 400 + 3 and tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    assert back(text)["input_ids"] == ids
    chat = back.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_vocab_size_must_exceed_the_bytes() -> None:
    with pytest.raises(ValueError, match="vocab_size=256 must exceed the 256 byte tokens"):
        train_bpe_tokenizer(["x"], vocab_size=256, model_max_length=8)
