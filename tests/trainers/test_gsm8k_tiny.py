"""The real-task path end to end: ``recipe=grpo_gsm8k_tiny`` builds GSM8K-format data through
``hybridrl prepare``'s code, a tiny Qwen2 with a BPE tokenizer trained here, and trains with the
``math`` reward of the pip-installed ``hybridrl-math-reward`` plugin, reporting mean@4 / pass@k.

The random start model (``tiny_bpe``, not the recipe's SFT warm start: that build takes ~2.5 min) rarely
writes a right answer, so what is checked is that every stage ran and that the numbers are consistent;
a 2-step run takes ~40 s on 2 cores (generation of 64 validation prompts × 4 samples dominates).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
def test_grpo_gsm8k_tiny_prepares_scores_with_math_verify_and_reports_pass_at_k(
        torchrun: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out"
    monkeypatch.setenv("HYBRIDRL_CACHE_DIR", str(cache))
    torchrun([str(REPO / "launch" / "train.py"), "recipe=grpo_gsm8k_tiny",
              # the random BPE model instead of the SFT warm start (see the module docstring)
              "actor_rollout_ref.model.path=${hybridrl_cache:}/tiny/gsm8k/random-qwen2-bpe",
              "actor_rollout_ref.model.build_if_missing=tiny_bpe", "trainer.total_training_steps=2",
              "trainer.test_freq=2", "trainer.val_before_train=false", f"trainer.output_dir={out}"], nproc=1)

    data = cache / "tiny" / "gsm8k"
    train = pq.read_table(data / "train.parquet").to_pylist()
    assert len(train) == 2000 and pq.read_table(data / "test.parquet").num_rows == 64
    row = train[0]
    assert row["data_source"] == "gsm8k" and row["prompt"][0]["role"] == "user"
    assert row["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert row["answer"].endswith(f"#### {row['ground_truth']}") or "," in row["answer"].rsplit("####", 1)[1]
    tokenizer = json.loads((cache / "tiny" / "gsm8k" / "random-qwen2-bpe" / "tokenizer.json").read_text())
    assert len(tokenizer["model"]["merges"]) > 100  # a trained BPE, not the char tokenizer

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    last = rows[-1]
    for k in ("mean@4", "pass@1", "pass@2", "pass@4"):
        assert 0.0 <= last[f"eval/gsm8k/{k}"] <= 1.0, k
    assert last["eval/gsm8k/pass@1"] == pytest.approx(last["eval/gsm8k/mean@4"])
    assert last["eval/gsm8k/pass@1"] <= last["eval/gsm8k/pass@2"] <= last["eval/gsm8k/pass@4"]
    assert last["reward/errors"] == 0.0 and 0.0 <= last["reward/mean"] <= 1.0
