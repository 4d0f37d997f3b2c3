"""``launch/train.py recipe=grpo_tiny`` with multi-turn rollouts and the actor (and ref) at TP=2 and at PP=2 on 2 ranks.

A few RL steps of the real loop (hf engine, Megatron actor and ref, weight sync) on a small random tiny model that
ends its turns often (:func:`chatty`), the arithmetic data in ChatML, no SFT bootstrap and no validation. The
rollout is multi-turn (``arithmetic_feedback``: a wrong answer gets feedback and another try), so every batch mixes
sampled ids with appended template/environment ids (``loss_mask`` 0) — the case where a mask slip would show. The
engine samples with the synced weights and the actor recomputes the log-probs sharded, so the engine/actor
agreement on every trained token (``rollout/logprob_abs_diff_max``) and the on-policy first mini-batch
(``actor/ppo_kl_first_mb``) check TP/PP forward, weight export and sync together; the same run on one rank is the
reference that every step's samples (the rollout dumps, token for token), rewards and update numbers must match.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support.e2e import MULTI_TURN, TRAIN, base_overrides, chatty, read_metrics, tiny  # noqa: F401

STEPS = 2  # step 2 samples with the weights step 1 synced: enough to compare the layouts


@pytest.fixture(scope="module")
def run(tiny: dict[str, Path]) -> dict[str, Path]:  # noqa: F811
    return {**tiny, "model": chatty(tiny["model"], tiny["tmp"] / "chatty")}


def overrides(run: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """4 prompts × 4 samples per step; 2 mini-batches of 8 samples, 2 micro-batches each; KL loss on; multi-turn
    episodes of up to 3 answers within 96 tokens, the calculator offered."""
    return base_overrides(
        run, out, "data.train_batch_size=4", *MULTI_TURN, f"trainer.rollout_data_dir={out}/dump",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        # a random model never solves arithmetic; a keyword reward gives it a learning signal (letters the feedback
        # text, which the reward reads too, does not hold)
        "reward.name=keyword", "+reward.kwargs.keywords=[q,z,x,j,k,w]", "+reward.kwargs.mode=fraction",
        f"trainer.total_training_steps={STEPS}", "trainer.val_before_train=false", "trainer.test_freq=0", *extra)


def dumps(out: Path) -> list[list[dict]]:
    return [[json.loads(line) for line in (out / "dump" / f"{s}.jsonl").read_text().splitlines()]
            for s in range(1, STEPS + 1)]


@pytest.fixture(scope="module")
def tp1(torchrun, run: dict[str, Path]) -> tuple[list[dict[str, float]], list[list[dict]]]:
    """The same run on one rank: the reference the split layouts must learn like."""
    out = run["tmp"] / "tp1"
    torchrun([TRAIN, *overrides(run, out)], nproc=1, timeout=300)
    return read_metrics(out), dumps(out)


@pytest.mark.distributed
def test_the_reference_run_is_multi_turn(tp1: tuple[list[dict[str, float]], list[list[dict]]]) -> None:
    rows, steps = tp1
    samples = [s for step in steps for s in step]
    assert all(r["multi_turn/turns_mean"] > 1.2 for r in rows), [r["multi_turn/turns_mean"] for r in rows]
    assert any(s["turns"] >= 2 for s in samples)
    for s in samples:  # the turns of the dump are the policy's runs; the feedback between them is not trained on
        assert len(s["loss_mask"]) == len(s["response_ids"]) <= 96 and s["loss_mask"][0] == 1
        if s["turns"] > 1:
            assert "That is not right. Try again." in s["output"] and 0 in s["loss_mask"]


@pytest.mark.distributed
@pytest.mark.parametrize("size", ["tensor_model_parallel_size", "pipeline_model_parallel_size"])
def test_grpo_tiny_trains_with_actor_and_ref_split_over_2_ranks(torchrun, run: dict[str, Path], size: str,
                                                               tp1: tuple[list[dict[str, float]], list[list[dict]]],
                                                               ) -> None:
    out = run["tmp"] / size
    layout = [f"actor_rollout_ref.{role}.megatron.{size}=2" for role in ("actor", "ref")]
    torchrun([TRAIN, *overrides(run, out, *layout)], nproc=2, timeout=300)
    rows, (tp1_rows, tp1_dumps) = read_metrics(out), tp1
    assert dumps(out) == tp1_dumps  # sample for sample, token for token, every step
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert all(math.isfinite(v) for v in r.values()), r
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4, r  # engine (synced weights) vs sharded actor, every token
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


MACHINE = ("timing/", "timing_cpu/", "perf/", "memory/", "throughput/")


@pytest.mark.distributed
def test_grpo_tiny_at_dp2_trains_what_one_rank_trains(torchrun, run: dict[str, Path]) -> None:
    """DP = 2 with ``trainer.balance_batch`` on (verl's default), on 3 prompts (verl splits samples, not prompts,
    over DP: one-step-off's 512 prompts on 3 trainer ranks): the ranks generate 2 and 1 prompts, the update's
    mini-batches are the one-rank run's, each split 6 and 6 samples over the ranks by tokens — every step metric
    equals one rank's to 1e-5 (before: other mini-batches at DP = 2, pg_loss 0.0047 vs 0.0034 at step 1).
    ~40 s: a 1-rank and a 2-rank launch."""
    odd = ("data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    got = []
    for nproc in (1, 2):
        out = run["tmp"] / f"odd{nproc}"
        torchrun([TRAIN, *overrides(run, out, *odd)], nproc=nproc, timeout=300)
        got.append((read_metrics(out), dumps(out)))
    (one, one_dumps), (two, two_dumps) = got
    assert two_dumps == one_dumps and [len(s) for s in one_dumps] == [12, 12]  # the same samples
    assert all(1.0 <= r["actor/dp_token_imbalance"] < 1.2 for r in two), [r["actor/dp_token_imbalance"] for r in two]
    for r, ref in zip(two, one, strict=True):
        compared = {k for k in ref if not k.startswith(MACHINE)}
        assert compared <= r.keys(), compared - r.keys()
        for k in compared:
            assert math.isclose(r[k], ref[k], rel_tol=1e-5, abs_tol=1e-5), (r["step"], k, r[k], ref[k])


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2], ids=["tp1", "tp2"])
def test_padded_rows_train_what_packed_rows_train(torchrun, run: dict[str, Path], nproc: int,
                                                  tp1: tuple[list[dict[str, float]], list[list[dict]]]) -> None:
    """``use_remove_padding=false`` (a padded row per sample; shared-prompt rows then off too) against the default
    (packed rows, each prompt once for its samples) on one rank: the same samples, and every step metric — losses,
    grad norm, KL, entropy, clip fraction — equal to 1e-5, on one rank and at TP=2 (PP=2 and CP=2:
    tests/parallel/test_rl_step_layouts.py). ~25 s a launch."""
    out = run["tmp"] / f"padded{nproc}"
    padded = ["actor_rollout_ref.actor.megatron.use_remove_padding=false",
              *(f"actor_rollout_ref.{role}.megatron.tensor_model_parallel_size={nproc}" for role in ("actor", "ref"))]
    torchrun([TRAIN, *overrides(run, out, *padded)], nproc=nproc, timeout=300)
    rows, (packed, packed_dumps) = read_metrics(out), tp1
    assert dumps(out) == packed_dumps
    assert all(r["perf/padding_share/update_actor"] > 0 for r in rows)  # it did pad
    assert all(r["perf/padding_share/update_actor"] == 0 for r in packed)
    for r, ref in zip(rows, packed, strict=True):
        compared = {k for k in ref if not k.startswith(MACHINE)}
        assert compared <= r.keys(), compared - r.keys()
        for k in compared:
            assert math.isclose(r[k], ref[k], rel_tol=1e-5, abs_tol=1e-5), (r["step"], k, r[k], ref[k])
