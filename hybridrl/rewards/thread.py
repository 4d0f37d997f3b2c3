"""``reward.num_workers=0``: the reward manager runs in a daemon thread of the trainer process.

Cheap (no process, no pickling) and it overlaps the trainer's compute, but a thread cannot be stopped: a call
still running at its deadline is abandoned (it dies with the process), so a timeout here always stops the run.
A reward that must be killable mid-call (C extensions holding the GIL, untrusted code) uses worker processes.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import traceback

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardManager
from hybridrl.rewards.scoring import Failure, Part, score_each, score_part, unfinished


class InThread:
    kills_on_timeout = False  # a stuck thread keeps running: timeouts cannot be survived

    def __init__(self, manager: RewardManager, *, timeout_s: float | None) -> None:
        self.manager, self.timeout_s = manager, timeout_s

    def start(self, batch: RolloutBatch, indices: list[int], *, each: bool) -> ThreadJob:
        return ThreadJob(self.manager, batch, indices, each=each, timeout_s=self.timeout_s)

    def close(self) -> None:
        pass


class ThreadJob:
    """One pass in its own thread; ``wait`` returns the parts done by the deadline, the rest as timed out."""

    def __init__(self, manager: RewardManager, batch: RolloutBatch, indices: list[int], *, each: bool,
                 timeout_s: float | None) -> None:
        # a shallow copy: the trainer sets fields of ``batch`` (log-probs) while this thread reads it
        view = dataclasses.replace(batch) if indices == list(range(len(batch))) else batch.index(indices)
        self.indices, self.each, self.timeout_s = indices, each, timeout_s
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._parts: list[Part] = []  # appended by the thread as calls finish
        self._thread = threading.Thread(target=self._run, args=(manager, view), name="hybridrl reward", daemon=True)
        self._thread.start()

    def _run(self, manager: RewardManager, view: RolloutBatch) -> None:
        try:
            for part in (score_each(manager, view, self.indices) if self.each
                         else [score_part(manager, view, self.indices)]):
                self._parts.append(part)
        except BaseException as e:  # e.g. SystemExit from the plugin: reported like any raised error
            done = {i for p in self._parts for i in p.indices}
            self._parts.append(Part(indices=[i for i in self.indices if i not in done], failure=Failure(
                kind="raised", summary=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())))

    def wait(self) -> list[Part]:
        self._thread.join(None if self.deadline is None else max(0.0, self.deadline - time.monotonic()))
        parts = list(self._parts)
        if self._thread.is_alive():
            done = sum(len(p.indices) for p in parts)
            parts += unfinished(self.indices[done:], each=self.each, kind="timeout",
                                summary=f"still running after {self.timeout_s} s (a thread cannot be stopped)")
        return parts
