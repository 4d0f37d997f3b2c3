"""``launch/train.py recipe=grpo_tiny`` with the actor (and ref) at TP=2 and at PP=2 on 2 ranks.

A few RL steps of the real loop (hf engine, Megatron actor and ref, weight sync) on a small random
tiny model and the arithmetic data, no SFT bootstrap and no validation. The engine samples with
the synced weights and the actor recomputes the log-probs sharded, so the engine/actor agreement
(``rollout/logprob_abs_diff``) and the on-policy first mini-batch (``actor/ppo_kl_first_mb``) check
TP/PP forward, weight export and sync together; the same run on one rank is the reference that every
step's rewards and update numbers must match (the split layouts learn like TP=1).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_train_e2e import TRAIN, base_overrides, read_metrics, tiny  # noqa: F401  (tiny is a fixture)

STEPS = 3


def overrides(run: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """4 prompts × 4 samples per step; 2 mini-batches of 8 samples, 2 micro-batches each; KL loss on."""
    return base_overrides(
        run, out, "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        # a random model never solves arithmetic; a keyword reward gives it a learning signal
        "reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "trainer.test_freq=0", *extra)


@pytest.fixture(scope="module")
def tp1_rows(torchrun, tiny: dict[str, Path]) -> list[dict[str, float]]:  # noqa: F811
    """The same run on one rank: the reference the split layouts must learn like."""
    out = tiny["tmp"] / "tp1"
    torchrun([TRAIN, *overrides(tiny, out)], nproc=1, timeout=300)
    return read_metrics(out)


@pytest.mark.distributed
@pytest.mark.parametrize("size", ["tensor_model_parallel_size", "pipeline_model_parallel_size"])
def test_grpo_tiny_trains_with_actor_and_ref_split_over_2_ranks(torchrun, tiny: dict[str, Path],  # noqa: F811
                                                               tp1_rows: list[dict[str, float]], size: str) -> None:  # noqa: F811
    out = tiny["tmp"] / size
    layout = [f"actor_rollout_ref.{role}.megatron.{size}=2" for role in ("actor", "ref")]
    torchrun([TRAIN, *overrides(tiny, out, *layout)], nproc=2, timeout=300)
    rows = read_metrics(out)
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
