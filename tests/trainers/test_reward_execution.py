"""Reward execution end to end (launch/train.py on a tiny model): on_error, worker processes, time limits; and
the validation of ``reward.*``.

A throwaway distribution (pip-installed into a temp site dir, as a third party would) registers a reward
``fault`` that misbehaves on chosen steps: it raises for (or hangs on) one prompt's samples of each rank's
batch, returns NaN, hangs on every call, or SIGKILLs its own worker process. Which prompt, and the step count,
live in a per-rank state file, so a worker that replaces a killed one, and the one-sample-at-a-time re-scoring,
see the same fault. Four
torchrun launches, 10–25 s each on 2 cores (the 2-rank one restarts a worker per rank): 60–105 s in all.
test_step_guards.py covers the thread-mode cases (a raise on one of 2 ranks, a hung thread, a wrong length).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from config.test_validate import base, issues  # noqa: F401  (base is a fixture)
from support.e2e import tiny  # noqa: F401  (a fixture)
from support.plugins import installed_plugin
from test_step_guards import rows, train

from hybridrl.config.schema import RewardConfig
from hybridrl.rewards.execution import config_problems, max_wait_s

FAULT_REWARD = """
import os, time
from dataclasses import dataclass, field
from pathlib import Path
import torch
from hybridrl.interfaces import RewardOutput

class Fault:
    overlaps_compute = True  # scores while the trainer computes log-probs

    @dataclass(kw_only=True, slots=True)
    class Config:
        # the fault of step k's batch: raise_group|sleep_group|nan|sleep|kill (the worker SIGKILLs itself)
        plan: list[str] = field(default_factory=list)
        state_dir: str = ""

    def __init__(self, config, *, tokenizer, **ctx):
        self.config = config
        self.state = Path(config.state_dir) / f"rank{os.environ.get('RANK', '0')}"

    def __call__(self, batch):
        if len(batch) > 1:  # a step's batch call: the next fault of the plan, on this batch's last prompt
            step = int(self.state.read_text().split()[0]) + 1 if self.state.exists() else 1
            fault = self.config.plan[step - 1] if step <= len(self.config.plan) else "none"
            self.state.write_text(f"{step} {fault} {int(batch.group_index.max())}")
        _, fault, target = self.state.read_text().split()
        (self.state.parent / f"{self.state.name}.call").write_text(f"{os.getpid()} {time.time()}")
        scores = batch.response_mask.sum(-1).float() % 2  # a learnable signal: odd lengths score 1
        hit = (batch.group_index == int(target)).nonzero().flatten().tolist()
        if fault == "raise_group" and hit:
            e = ValueError(f"cannot score prompt {target}")
            e.sample_index = hit[0]
            raise e
        if fault == "kill":
            os.kill(os.getpid(), 9)
        if fault == "sleep" or (fault == "sleep_group" and hit):
            time.sleep(10**6)
        if fault == "nan":
            scores[0] = float("nan")
        return RewardOutput(scores_B=scores)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return installed_plugin(tmp_path_factory.mktemp("fault_reward_exec"), "fault_reward_exec",
                            "hybridrl.reward_managers", {"fault": "fault_reward_exec:Fault"}, FAULT_REWARD)


def run(tiny: dict[str, Path], site: Path, name: str, plan: list[str], *extra: str,  # noqa: F811
        nproc: int = 1) -> tuple[object, Path, Path, float]:
    out, state = tiny["tmp"] / name, tiny["tmp"] / f"{name}-state"
    state.mkdir()
    proc, took = train(tiny, site, out, f"+reward.kwargs.plan=[{','.join(plan)}]", f"+reward.kwargs.state_dir={state}",
                       f"trainer.total_training_steps={len(plan)}", *extra, nproc=nproc)
    return proc, out, state, took


@pytest.mark.distributed
def test_zero_scores_failing_samples_0_counts_them_and_a_nan_still_skips(tiny: dict[str, Path],  # noqa: F811
                                                                         site: Path) -> None:
    """1 rank, in a thread: step 1's batch raises for one prompt (4 samples); re-scored one sample at a time,
    those 4 score 0 and the step trains; step 2's NaN is no error of a sample: the step guard skips it."""
    proc, out, _, took = run(tiny, site, "zero-thread", ["raise_group", "nan", "none"], "reward.on_error=zero")
    assert proc.returncode == 0, proc.stderr[-3000:]  # type: ignore[attr-defined]
    got = rows(out)
    assert got[0]["reward/errors"] == 4.0 and got[2]["reward/errors"] == 0.0
    assert got[1] == {"step": 2, "training/skipped_steps": 1}
    warnings = [ln for ln in proc.stderr.splitlines() if "WARNING" in ln]  # type: ignore[attr-defined]
    assert len(warnings) == 1, warnings  # one line for the step
    assert ("[hybridrl] WARNING rank 0: reward.name='fault': 4 of 16 samples failed and score 0.0 (reward.on_error="
            "zero; counted in reward/errors): sample ") in warnings[0]
    assert "ValueError: cannot score prompt" in warnings[0]
    print(f"zero, thread, 1 rank: {took:.0f} s")


@pytest.mark.distributed
def test_workers_on_2_ranks_survive_a_raise_and_a_hang(tiny: dict[str, Path], site: Path) -> None:  # noqa: F811
    """2 ranks, 1 worker each, on_error=zero, timeout 3 s. Step 1: one prompt raises on each rank (4 samples
    each, 8 summed over DP). Step 2: one prompt hangs on each rank: the worker is killed at 3 s, a fresh one
    re-scores the samples one at a time; the hanging sample and those queued behind it in that worker score 0."""
    proc, out, state, took = run(tiny, site, "zero-pool", ["raise_group", "sleep_group"], "reward.on_error=zero",
                                 "reward.num_workers=1", "reward.timeout_s=3", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]  # type: ignore[attr-defined]
    got = rows(out)
    assert got[0]["reward/errors"] == 8.0
    assert 8.0 <= got[1]["reward/errors"] <= 16.0
    assert "still running after reward.timeout_s=3.0 s; worker killed" in proc.stderr  # type: ignore[attr-defined]
    for rank in (0, 1):  # the last worker of each rank (hung in step 2's re-scoring) is gone with its rank
        pid = int((state / f"rank{rank}.call").read_text().split()[0])
        assert not _alive(pid), pid
    print(f"zero, 1 worker per rank, 2 ranks: {took:.0f} s")


@pytest.mark.distributed
def test_a_hung_worker_is_killed_and_stops_the_run_within_the_limit(tiny: dict[str, Path],  # noqa: F811
                                                                    site: Path) -> None:
    proc, _, state, _ = run(tiny, site, "raise-pool", ["sleep"], "reward.num_workers=1", "reward.timeout_s=3")
    ended = time.time()
    assert proc.returncode != 0
    assert "reward.name='fault': scoring one batch took longer than 3.0 s" in proc.stderr  # type: ignore[attr-defined]
    pid, began = (state / "rank0.call").read_text().split()
    assert not _alive(int(pid))
    print(f"the run ended {ended - float(began):.1f} s after the hung call began")
    assert ended - float(began) < 3 + 15  # the limit, then the rank's exit and torchrun's teardown


@pytest.mark.distributed
def test_a_sigkilled_worker_stops_the_run_naming_it_and_leaves_no_process(tiny: dict[str, Path],  # noqa: F811
                                                                          site: Path) -> None:
    """A reward worker process killed (SIGKILL, mid-call) under reward.on_error=raise: the run ends at once, non-zero,
    saying which reward and how the worker died; neither the worker nor the rank is left."""
    proc, _, state, took = run(tiny, site, "kill-pool", ["kill"], "reward.num_workers=1")
    assert proc.returncode != 0
    assert "reward.name='fault': its reward worker died (killed by SIGKILL)" in proc.stderr, \
        proc.stderr[-3000:]  # type: ignore[attr-defined]
    pid, _ = (state / "rank0.call").read_text().split()
    assert not _alive(int(pid))
    print(f"reward worker SIGKILL: the run ended after {took:.1f} s in all")


# ---- validation ----------------------------------------------------------------------------------------------------

def test_reward_keys_are_validated_by_name(base: list[str]) -> None:  # noqa: F811
    found = issues(base, "reward.on_error=ignore", "reward.num_workers=-1")
    assert "reward.on_error='ignore': valid: raise, zero" in found
    assert "reward.num_workers=-1: must be ≥ 0 (0: score in a thread of the trainer process; N: in N worker " \
           "processes)" in found
    found = issues(base, "reward.name=function", "+reward.kwargs.path=nowhere_xyz:f")
    assert len(found) == 1 and found[0].startswith("reward.kwargs={'path': 'nowhere_xyz:f'}: plugin 'function' at "
                                                   "reward.kwargs: reward.kwargs.path='nowhere_xyz:f': importing the "
                                                   "module 'nowhere_xyz' raised ModuleNotFoundError"), found


def test_the_worst_case_wait_stays_below_the_collective_timeout(base: list[str]) -> None:  # noqa: F811
    assert max_wait_s(RewardConfig(timeout_s=60)) == 60
    assert max_wait_s(RewardConfig(timeout_s=60, on_error="zero")) == 120  # + the re-scoring pass
    assert max_wait_s(RewardConfig(timeout_s=60, num_workers=2)) == 60 + 300  # + a worker start (at least 300 s)
    assert max_wait_s(RewardConfig(timeout_s=None)) is None
    found = issues(base, "reward.timeout_s=1000", "reward.on_error=zero", "reward.num_workers=2")
    assert found == ["reward.timeout_s=1000.0: a rank may wait up to 4000 s for one batch's scores (reward.on_error="
                     "zero: 2 pass(es) of reward.timeout_s, each after a worker start of up to 1000 s) while the "
                     "other ranks wait in a collective: keep that below trainer.dist_timeout_s=3600 (lower "
                     "reward.timeout_s or raise trainer.dist_timeout_s)"], found
    assert not config_problems(RewardConfig(timeout_s=600, on_error="zero", num_workers=2), dist_timeout_s=3600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
