"""Multi-turn episodes in asynchronous mode (``hybridrl/rollout/async_rollout.py`` with ``multi_turn.enable``): the
engine rank plays whole episodes — its engine, the calculator tool, the arithmetic_feedback environment — ahead of
the trainer. At staleness 0 that is the synchronous multi-turn run; with partial rollouts an episode's turns span
weight versions and the bound still holds."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from support.e2e import MULTI_TURN, TRAIN, chatty, overrides, read_metrics, tiny  # noqa: F401

AOR = "actor_rollout_ref"
ASYNC = (f"{AOR}.rollout.placement=disaggregated", f"{AOR}.rollout.num_ranks=1", "async_training.enable=true")


@pytest.fixture(scope="module")
def chatty_tiny(tiny: dict[str, Path]) -> dict[str, Path]:  # noqa: F811
    return {**tiny, "model": chatty(tiny["model"], tiny["tmp"] / "chatty_async")}


def run(torchrun, model: dict[str, Path], name: str, nproc: int, *extra: str) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    out = model["tmp"] / name
    torchrun([TRAIN, *overrides(model, out, *MULTI_TURN, "trainer.val_before_train=false", *extra)], nproc=nproc,
             timeout=600)
    return [r for r in read_metrics(out) if r["step"] > 0]


@pytest.mark.distributed
def test_asynchronous_episodes_at_staleness_0_are_the_synchronous_multi_turn_run(  # type: ignore[no-untyped-def]
        torchrun, chatty_tiny: dict[str, Path]) -> None:
    """1 trainer + 1 engine rank at S = 0 against one colocated rank: the same episodes (turns, tool calls,
    environment rewards), so the same metrics to 1e-6, evaluation included. ~35 s: two launches."""
    sync = run(torchrun, chatty_tiny, "mt_sync", 1)
    got = run(torchrun, chatty_tiny, "mt_async0", 2, *ASYNC)
    assert [r["step"] for r in got] == [r["step"] for r in sync] == [1, 2, 3]
    assert sync[0]["multi_turn/turns_mean"] > 1.2  # real multi-turn episodes
    for a, c in zip(got, sync, strict=True):
        compared = {k for k in c if not k.startswith(("timing", "perf/"))}
        assert compared <= a.keys()
        for k in compared:
            assert math.isclose(a[k], c[k], rel_tol=0, abs_tol=1e-6), (a["step"], k, a[k], c[k])
    assert "eval/accuracy" in got[-1] and all(r["async/staleness_max"] == 0 for r in got)


@pytest.mark.distributed
def test_interrupted_episodes_continue_on_new_weights_within_the_bound(  # type: ignore[no-untyped-def]
        torchrun, chatty_tiny: dict[str, Path]) -> None:
    """S = 2 with partial rollouts, the engine decoding one episode at a time (``max_batch_size=1``) and 8 episodes a
    prompt, so that generating a batch takes longer than training on one and each update lands inside a batch of
    episodes: episodes whose turns span versions, never more than S behind. (With 4 episodes a prompt a loaded
    machine once let the engine finish its batches between updates: nothing was interrupted.) ~20 s: one launch of
    5 steps."""
    got = run(torchrun, chatty_tiny, "mt_partial", 2, *ASYNC, "async_training.staleness_threshold=2",
              "async_training.partial_rollout=true", "algorithm.rollout_correction.rollout_is=token",
              "trainer.total_training_steps=5", "trainer.test_freq=0", f"{AOR}.rollout.n=8",
              f"+{AOR}.rollout.engine_kwargs.max_batch_size=1")
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_samples"] == 0 for r in got)
    assert all(r["multi_turn/turns_mean"] > 1 for r in got)
    assert sum(r["async/partial_samples"] for r in got[1:]) > 0


PARITY_REWARD = """
def score(batch, tokenizer):  # 1 for a third of the episodes, by their token ids: most groups have signal, some not
    return [float(sum(ids) % 3 == 0) for ids in batch.response_ids]
"""


@pytest.mark.distributed
def test_episodes_filtered_by_dynamic_sampling_ahead_of_the_trainer(  # type: ignore[no-untyped-def]
        torchrun, chatty_tiny: dict[str, Path]) -> None:
    """``algorithm.filter_groups`` over asynchronous episodes (``hybridrl/rollout/async_dynamic.py``), S = 1 with
    partial rollouts: rounds of 2 prompts' episodes played on the engine rank until 4 groups with signal; every step
    full, the episodes' metrics over its rounds, one version behind at most. ~20 s: one launch of 3 steps."""
    fn = chatty_tiny["tmp"] / "parity_reward.py"
    fn.write_text(PARITY_REWARD)
    got = run(torchrun, chatty_tiny, "mt_dapo", 2, *ASYNC, "async_training.staleness_threshold=1",
              "async_training.partial_rollout=true", "algorithm.rollout_correction.rollout_is=token",
              "trainer.test_freq=0", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
              "data.gen_batch_size=2", "algorithm.filter_groups.max_num_gen_batches=4", "reward.name=function",
              f"+reward.kwargs.path={fn}:score", "+reward.kwargs.granularity=batch")
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:
        rounds, kept, dropped, refilled = (int(r[f"dynamic_sampling/{k}"]) for k in
                                           ("gen_rounds", "kept_groups", "dropped_groups", "refilled_groups"))
        assert 2 <= rounds <= 4 and kept + dropped == 2 * rounds, r
        assert refilled == (max(4 - kept, 0) if rounds == 4 else 0), r
        assert r["multi_turn/turns_mean"] > 1 and r["async/staleness_max"] <= 1 and r["async/dropped_samples"] == 0
    assert [r["async/staleness_max"] for r in got] == [0.0, 1.0, 1.0]  # later steps' rounds played ahead
    assert sum(r["dynamic_sampling/kept_groups"] for r in got) >= 12  # filled with signal, not by refills
