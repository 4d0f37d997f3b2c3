"""Preemption on real 2-rank runs (``hybridrl/preemption.py``): SIGTERM as Slurm sends it (to every rank) and as
torchrun forwards it; and a step plus save that do not fit in ``trainer.preempt_grace_s``.

Time: ~80 s on 2 cores (four runs of a tiny model; the uninterrupted reference is conftest's)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from faults.runs import after_step, left_behind, metrics, rank_pids, run_to_end, run_with_fault, train_args

from hybridrl.checkpoint.rl import LATEST, checkpoint_problem, latest_complete, step_dirs

pytestmark = pytest.mark.distributed
GRACE_S = 20.0  # trainer.preempt_grace_s's default


def _sigterm_ranks(proc: subprocess.Popen[bytes]) -> None:
    """As Slurm sends it: to each rank directly."""
    for pid in rank_pids(proc):
        os.kill(pid, signal.SIGTERM)


def test_sigterm_to_every_rank_saves_the_step_in_flight_and_resume_continues_bitwise(tiny: Path,
                                                                                   reference: Path) -> None:
    """A run without periodic saves, SIGTERMed on both ranks in step 3: it saves that step, exits 0 within the grace
    period, leaves no process; ``resume=auto`` runs steps 4-6 exactly as the uninterrupted run did."""
    out = tiny / "ranks"
    args = train_args(tiny, out)
    ended = run_with_fault(args, when=after_step(2), fault=_sigterm_ranks, log=tiny / "ranks.log")
    print(f"SIGTERM to every rank: exit {ended.code} {ended.seconds_after_fault:.1f} s later")
    assert ended.code == 0, ended.log[-4000:]
    assert ended.seconds_after_fault < GRACE_S, ended.seconds_after_fault
    assert left_behind(ended.mark) == []
    [(k, path)] = step_dirs(out / "checkpoints")
    assert 3 <= k < 6 and latest_complete(out / "checkpoints") == path and checkpoint_problem(path) is None, k
    assert "preempted (rank 0: SIGTERM" in ended.log and f"stopped after step {k}" in ended.log
    assert max(metrics(out)) == k  # nothing of a later step was logged
    run_to_end(args)  # resume=auto
    assert metrics(out) == metrics(reference)


def test_sigterm_to_torchrun_is_forwarded_and_the_ranks_save_and_exit_0(tiny: Path) -> None:
    """torchrun forwards a SIGTERM to its ranks, which stop after their step with a checkpoint and exit 0; torchrun
    itself then exits 1 (torch.distributed.elastic re-raises the signal as ``SignalException``)."""
    out = tiny / "torchrun"
    ended = run_with_fault(train_args(tiny, out), when=after_step(2), fault=lambda p: p.send_signal(signal.SIGTERM),
                           log=tiny / "torchrun.log")
    print(f"SIGTERM to torchrun: exit {ended.code} {ended.seconds_after_fault:.1f} s later")
    assert ended.code == 1 and "SignalException" in ended.log, ended.log[-4000:]
    assert "preempted (rank 0: SIGTERM" in ended.log and "exitcode" not in ended.log  # no rank failed
    assert ended.seconds_after_fault < GRACE_S and left_behind(ended.mark) == []
    [(k, path)] = step_dirs(out / "checkpoints")
    assert k >= 3 and checkpoint_problem(path) is None


def test_a_save_that_does_not_fit_in_the_grace_period_exits_143_and_commits_nothing(tiny: Path) -> None:
    """``trainer.preempt_grace_s=0.3`` and SIGTERM in step 2: the step plus its save (a first save: ~1 s) take longer,
    so each rank exits 143 at the deadline naming the key and where it was; nothing is committed (the half-written
    save is scratch that the next start removes) and no process is left."""
    out = tiny / "late"
    ended = run_with_fault(train_args(tiny, out, "trainer.preempt_grace_s=0.3"), when=after_step(1),
                           fault=_sigterm_ranks, log=tiny / "late.log")
    print(f"SIGTERM, grace 0.3 s: exit {ended.code} {ended.seconds_after_fault:.1f} s later")
    assert ended.code != 0 and "exitcode  : 143" in ended.log, ended.log[-4000:]
    assert re.search(r"SIGTERM 0.3 s ago \(trainer.preempt_grace_s\) and still (in|saving) step 2: exiting 143",
                     ended.log), ended.log[-4000:]
    assert ended.seconds_after_fault < 10 and left_behind(ended.mark) == []
    root = out / "checkpoints"
    assert latest_complete(root) is None and not (root / LATEST).exists()
