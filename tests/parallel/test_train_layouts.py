"""``launch/train.py recipe=grpo_tiny`` with the actor (and ref) at TP=2 and at PP=2 on 2 ranks.

A few RL steps of the real loop (hf engine, Megatron actor and ref, weight sync) on a small random
tiny model and the arithmetic data, no SFT bootstrap and no validation. The engine samples with
the synced weights and the actor recomputes the log-probs sharded, so the engine/actor agreement
(``rollout/logprob_abs_diff``) and the on-policy first mini-batch (``actor/ppo_kl_first_mb``) check
TP/PP forward, weight export and sync together; the same run on one rank is the reference that every
step's rewards and update numbers must match (the split layouts learn like TP=1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybridrl.bootstrap import ensure_data
from hybridrl.models.tiny import make_tiny_model

TRAIN = str(Path(__file__).resolve().parents[2] / "launch" / "train.py")
STEPS = 3


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("train_layouts")
    model = make_tiny_model(tmp / "model", hidden=64, layers=2, heads=4, kv_heads=2, max_positions=128)
    train, test = tmp / "train.parquet", tmp / "test.parquet"
    ensure_data("arithmetic", [str(train)], [str(test)])
    return {"model": model, "train": train, "test": test, "tmp": tmp}


def overrides(run: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """4 prompts × 4 samples per step; 2 mini-batches of 8 samples, 2 micro-batches each; KL loss on."""
    return ["recipe=grpo_tiny", f"actor_rollout_ref.model.path={run['model']}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{run['train']}]",
            f"data.val_files=[{run['test']}]", "data.build_if_missing=null", "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            # a random model never solves arithmetic; a keyword reward gives it a learning signal
            "reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any",
            f"trainer.total_training_steps={STEPS}",
            "trainer.val_before_train=false", "trainer.test_freq=0",
            f"trainer.output_dir={out}", *extra]


def _rows(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tp1_rows(torchrun, tiny_run: dict[str, Path]) -> list[dict[str, float]]:
    """The same run on one rank: the reference the split layouts must learn like."""
    out = tiny_run["tmp"] / "tp1"
    torchrun([TRAIN, *overrides(tiny_run, out)], nproc=1, timeout=300)
    return _rows(out)


@pytest.mark.distributed
@pytest.mark.parametrize("size", ["tensor_model_parallel_size", "pipeline_model_parallel_size"])
def test_grpo_tiny_trains_with_actor_and_ref_split_over_2_ranks(torchrun, tiny_run: dict[str, Path],
                                                               tp1_rows: list[dict[str, float]], size: str) -> None:
    out = tiny_run["tmp"] / size
    layout = [f"actor_rollout_ref.{role}.megatron.{size}=2" for role in ("actor", "ref")]
    torchrun([TRAIN, *overrides(tiny_run, out, *layout)], nproc=2, timeout=300)
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert all(math.isfinite(v) for v in r.values()), r
        assert r["rollout/logprob_abs_diff"] <= 1e-4, r  # engine (synced weights) vs sharded actor
        assert abs(r["actor/ppo_kl_first_mb"]) <= 1e-6, r  # first mini-batch is on-policy
    assert 0 < rows[0]["reward/mean"] < 1 and rows[0]["actor/grad_norm"] > 0  # a policy gradient
    assert 0 <= rows[0]["actor/kl_ref"] < rows[-1]["actor/kl_ref"]  # the actor moves away from the ref
    # learns like TP=1: same seed, so the same samples and rewards every step while the weights agree
    # to fp32 round-off (a flipped sample would show as a reward difference); the update numbers match
    for r, ref in zip(rows, tp1_rows, strict=True):
        assert r["reward/mean"] == ref["reward/mean"], (r["step"], r["reward/mean"], ref["reward/mean"])
        for key in ("actor/pg_loss", "actor/kl_ref", "actor/entropy"):
            assert r[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (r["step"], key)
        assert r["actor/grad_norm"] == pytest.approx(ref["actor/grad_norm"], rel=1e-4), r["step"]
