"""RewardRunner: time limits, on_error, worker processes and overlap, on a ``function`` reward that misbehaves on
chosen samples (its ground truth says how: raise, sleep, exit, segv).

The worker-pool tests share one pool (2 workers); each kill or crash costs a respawn (2–5 s on 2 cores: spawn,
torch + transformers imports, tokenizer), hence 20–60 s for this file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from hybridrl.batch import RolloutBatch
from hybridrl.config.schema import RewardConfig
from hybridrl.interfaces import RewardOutput
from hybridrl.registry import PluginLoadError
from hybridrl.rewards.execution import RewardRunner, overlaps_compute
from hybridrl.rewards.pool import PluginSpec, WorkerPool
from hybridrl.rewards.scoring import RewardError, RewardTimeoutError
from hybridrl.rewards.thread import InThread

MakeBatch = Callable[..., RolloutBatch]  # the make_batch fixture of conftest.py

FAULTS = """
import ctypes, os, time

def score(response, ground_truth, *, data_source, extra, prompt):
    if ground_truth == "raise":
        raise ValueError(f"cannot score {response!r}")
    if ground_truth == "sleep":
        time.sleep(10**6)
    if ground_truth == "exit":
        os._exit(3)
    if ground_truth == "segv":
        ctypes.string_at(0)
    if ground_truth == "slow":
        time.sleep(0.3)
    if ground_truth.startswith("gate:"):  # held until the test creates the file
        while not os.path.exists(ground_truth[5:]):
            time.sleep(0.01)
    return float(len(response))
"""
TIMEOUT_S = 2.0
START_S = 15.0  # generous for a worker start (spawn, imports, tokenizer) on a busy 2-core machine


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "faults.py"
    path.write_text(FAULTS)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory, tok: PreTrainedTokenizerBase) -> Path:
    path = tmp_path_factory.mktemp("tok")
    tok.save_pretrained(path)
    return path


def runner(faults: Path, tok: PreTrainedTokenizerBase, tok_dir: Path, **cfg: object) -> RewardRunner:
    config = RewardConfig(name="function", kwargs={"path": f"{faults}:score"}, **cfg)  # type: ignore[arg-type]
    return RewardRunner.build(config, tokenizer=tok, tokenizer_path=str(tok_dir))


def lengths(responses: list[str]) -> list[float]:
    return [float(len(r)) for r in responses]


# ---- thread mode -------------------------------------------------------------------------------------------------

def test_raise_names_the_plugin_the_sample_and_the_original_traceback(faults: Path, tok: PreTrainedTokenizerBase,
                                                                      tok_dir: Path, make_batch: MakeBatch) -> None:
    r = runner(faults, tok, tok_dir, timeout_s=TIMEOUT_S)
    with pytest.raises(RewardError) as e:
        r.score(make_batch(["ab", "cde", "f"], ["1", "raise", "2"]))
    msg = str(e.value)
    assert msg.startswith("reward.name='function' raised ValueError: cannot score 'cde' on sample 1 (dataset row 1) "
                          "of this rank's 3"), msg
    assert "reward.on_error=zero would score failing samples 0.0" in msg
    assert "Original traceback:" in msg and 'faults.py", line 6, in score' in msg  # the user's own frame


def test_zero_rescores_one_sample_at_a_time_and_counts(faults: Path, tok: PreTrainedTokenizerBase, tok_dir: Path,
                                                       make_batch: MakeBatch, capsys: pytest.CaptureFixture) -> None:
    r = runner(faults, tok, tok_dir, timeout_s=TIMEOUT_S, on_error="zero")
    responses = ["ab", "cde", "f", "ghij"]
    scored = r.score(make_batch(responses, ["1", "raise", "2", "raise"]))
    assert scored.output.scores_B.tolist() == [2.0, 0.0, 1.0, 0.0]
    assert scored.errors == 2
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1  # one line per call
    assert ("reward.name='function': 2 of 4 samples failed and score 0.0 (reward.on_error=zero; counted in "
            "reward/errors): sample 1 (dataset row 1): ValueError: cannot score 'cde'; sample 3 (dataset row 3): "
            "ValueError: cannot score 'ghij'") in err
    ok = r.score(make_batch(responses, ["1", "2", "3", "4"]))
    assert ok.errors == 0 and ok.output.scores_B.tolist() == lengths(responses)


def test_a_stuck_thread_always_stops_the_run_pointing_to_workers(faults: Path, tok: PreTrainedTokenizerBase,
                                                                 tok_dir: Path, make_batch: MakeBatch) -> None:
    r = runner(faults, tok, tok_dir, timeout_s=TIMEOUT_S, on_error="zero")  # even under zero: a thread can't be killed
    t0 = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=r"reward.name='function': scoring one batch took longer than 2.0 s.*"
                                                 r"reward.num_workers > 0"):
        r.score(make_batch(["ab", "c"], ["1", "sleep"]))
    assert time.monotonic() - t0 < TIMEOUT_S + 1.0


class _Slow:
    """A reward without the overlap flag: it must be done when submit returns."""

    calls: ClassVar[int] = 0

    def __call__(self, batch: RolloutBatch) -> RewardOutput:
        time.sleep(0.3)
        type(self).calls += 1
        return RewardOutput(scores_B=torch.ones(len(batch)))


def test_overlap_only_where_the_reward_allows_it(faults: Path, tok: PreTrainedTokenizerBase, tok_dir: Path,
                                                 make_batch: MakeBatch, tmp_path: Path) -> None:
    """Forced, not timed: the overlapping reward is held at a gate that opens only after ``submit`` returned (had
    ``submit`` waited for it, the scoring would time out); the other one has scored when ``submit`` returns."""
    gate = tmp_path / "open"
    batch = make_batch(["ab", "c"], [f"gate:{gate}", f"gate:{gate}"])
    r = runner(faults, tok, tok_dir, timeout_s=TIMEOUT_S)
    assert r.overlaps  # FunctionReward.overlaps_compute
    pending = r.submit(batch)  # returns with the reward still held: the caller computes meanwhile
    gate.touch()
    assert pending.result().output.scores_B.tolist() == [2.0, 1.0]

    assert overlaps_compute(_Slow, "slow") is False  # absent: the safe default
    plain = RewardRunner(InThread(_Slow(), timeout_s=TIMEOUT_S), name="slow", on_error="raise", timeout_s=TIMEOUT_S,
                         overlaps=overlaps_compute(_Slow, "slow"))
    before = _Slow.calls
    pending = plain.submit(batch)
    assert _Slow.calls == before + 1  # scored before submit returned
    assert pending.result().output.scores_B.tolist() == [1.0, 1.0]

    class Bad(_Slow):
        overlaps_compute = "yes"

    with pytest.raises(PluginLoadError, match="`overlaps_compute` is 'yes'; it must be a bool"):
        overlaps_compute(Bad, "bad")


def test_the_output_contract_is_not_a_sample_error(make_batch: MakeBatch) -> None:
    class Short:
        def __call__(self, batch: RolloutBatch) -> RewardOutput:
            return RewardOutput(scores_B=torch.ones(1))

    r = RewardRunner(InThread(Short(), timeout_s=None), name="short", on_error="zero", timeout_s=None, overlaps=False)
    with pytest.raises(ValueError, match=r"reward.name='short' returned scores_B of shape \(1,\); expected \(3,\)"):
        r.score(make_batch(["a", "b", "c"]))


def test_training_scores_carry_the_overlong_penalty_and_evaluation_scores_do_not(make_batch: MakeBatch) -> None:
    """DAPO's soft overlong punishment is the runner's (reward.overlong_buffer, len 2 before the longest length T):
    lengths T, T − 1 and 1 lose 1, 0.5 and 0 of their score in training; ``score`` (evaluation) leaves it whole."""
    from hybridrl.rewards.overlong import OverlongBufferConfig

    class Ones:
        def __call__(self, batch: RolloutBatch) -> RewardOutput:
            return RewardOutput(scores_B=torch.ones(len(batch)))

    batch = make_batch(["123456", "12345", "1"])
    T = batch.response_mask.shape[1]
    assert batch.response_mask.sum(-1).tolist() == [T, T - 1, 1] and T > 3, batch.response_mask
    r = RewardRunner(InThread(Ones(), timeout_s=None), name="ones", on_error="raise", timeout_s=None, overlaps=False,
                     overlong=OverlongBufferConfig(enable=True, len=2, penalty_factor=1.0), max_response_length=T)
    scores_B, errors = r.training_scores(batch, r.submit(batch))
    assert errors == 0 and scores_B.tolist() == [0.0, 0.5, 1.0]
    assert r.score(batch).output.scores_B.tolist() == [1.0, 1.0, 1.0]
    off = RewardRunner(InThread(Ones(), timeout_s=None), name="ones", on_error="raise", timeout_s=None, overlaps=False)
    assert off.training_scores(batch, off.submit(batch))[0].tolist() == [1.0, 1.0, 1.0]


# ---- worker processes --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(faults: Path, tok_dir: Path) -> Iterator[WorkerPool]:
    spec = PluginSpec(name="function", kwargs={"path": f"{faults}:score"}, tokenizer_path=str(tok_dir), ctx={})
    p = WorkerPool(spec, num_workers=2, timeout_s=TIMEOUT_S, what="reward.name='function'")
    yield p
    p.close()


def on(pool: WorkerPool, on_error: str) -> RewardRunner:
    return RewardRunner(pool, name="function", on_error=on_error, timeout_s=TIMEOUT_S, overlaps=True)


def ready(pool: WorkerPool) -> None:
    """Replace killed workers now, so that the timed part of a test measures scoring only."""
    pool._ensure_ready()


@pytest.mark.slow
def test_pool_scores_shards_and_raise_names_the_sample(pool: WorkerPool, make_batch: MakeBatch) -> None:
    responses = ["ab", "cde", "f", "ghij", "k"]
    scored = on(pool, "raise").score(make_batch(responses, ["1"] * 5))
    assert scored.errors == 0 and scored.output.scores_B.tolist() == lengths(responses)
    with pytest.raises(RewardError) as e:
        on(pool, "raise").score(make_batch(responses, ["1", "2", "3", "raise", "4"]))
    msg = str(e.value)
    assert "raised ValueError: cannot score 'ghij' on sample 3 (dataset row 3) of this rank's 5" in msg
    assert 'faults.py", line 6, in score' in msg  # the traceback text came back from the worker


@pytest.mark.slow
def test_pool_kills_a_hung_worker_and_zero_isolates_the_sample(pool: WorkerPool, make_batch: MakeBatch) -> None:
    ready(pool)
    pids = [w.process.pid for w in pool.workers]
    t0 = time.monotonic()
    with pytest.raises(RewardTimeoutError, match="scoring one batch took longer than 2.0 s"):
        on(pool, "raise").score(make_batch(["ab", "c", "d", "e"], ["1", "sleep", "2", "3"]))
    took = time.monotonic() - t0
    assert TIMEOUT_S <= took < TIMEOUT_S + 1.0, took
    assert not _alive(pids[0]) and _alive(pids[1])  # the hung worker (samples 0–1) was killed, the other kept

    ready(pool)
    responses = ["ab", "c", "de", "fgh"]
    t0 = time.monotonic()
    scored = on(pool, "zero").score(make_batch(responses, ["1", "sleep", "2", "3"]))
    took = time.monotonic() - t0
    # pass 1 times out on shard [0, 1]; a fresh worker starts; pass 2 re-scores 0 and 1 alone: 1 times out again
    assert scored.output.scores_B.tolist() == [2.0, 0.0, 2.0, 3.0] and scored.errors == 1
    assert took < 2 * TIMEOUT_S + START_S, took


@pytest.mark.slow
def test_a_crashed_worker_is_a_clear_error_or_zero(pool: WorkerPool, make_batch: MakeBatch) -> None:
    ready(pool)
    with pytest.raises(RewardError, match=r"reward.name='function': its reward worker died \(exit code 3\); the "
                                          "sample is not known"):
        on(pool, "raise").score(make_batch(["ab", "c", "d"], ["1", "2", "exit"]))
    ready(pool)
    scored = on(pool, "zero").score(make_batch(["ab", "c", "d"], ["1", "2", "segv"]))
    assert scored.output.scores_B.tolist() == [2.0, 1.0, 0.0] and scored.errors == 1


def test_a_plugin_that_cannot_be_built_in_a_worker_stops_the_run(faults: Path, tmp_path: Path) -> None:
    spec = PluginSpec(name="function", kwargs={"path": f"{faults}:score"}, tokenizer_path=str(tmp_path / "none"),
                      ctx={})
    p = WorkerPool(spec, num_workers=1, timeout_s=TIMEOUT_S, what="reward.name='function'")
    try:
        with pytest.raises(RewardError, match=r"(?s)reward.name='function' could not be built in a reward worker "
                                              r"\(reward.num_workers=1\): .*Traceback in the worker"):
            p._ensure_ready()
    finally:
        p.close()


def _alive(pid: int | None) -> bool:
    assert pid is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
