"""``reward.num_workers=N``: the reward manager in N worker processes (spawned) that can be killed mid-call.

For rewards a thread cannot interrupt: C extensions that hold the GIL, generated code run in-process, anything
that may hang or crash. Each worker builds the plugin once, from what a fresh process can rebuild: the registry
name, ``reward.kwargs`` and the tokenizer's path (it reloads the tokenizer); so the plugin must be an installed
entry point, and whatever its config names (a ``function`` reward's module or file) importable there. A pass
splits its samples into N contiguous shards, one per worker; only the spec and the batches are pickled.

- A worker still scoring at the deadline (``reward.timeout_s`` after its shard was sent) is killed; a worker
  that dies (segfault, ``os._exit``) is reported with its exit status. Either way the next pass starts a
  fresh worker in its place (the healthy ones are kept).
- Starting workers (spawn, imports, building the plugin) is a wait of its own, bounded by ``start_timeout_s``
  (``reward.timeout_s``, at least ``MIN_START_S``: a start must not fail for a tight scoring limit); a plugin that
  cannot be built in a worker, or a worker that dies or hangs while starting, stops the run.
- Workers are not daemonic (a plugin may start processes of its own), are killed when the runner closes or
  the process exits, and on Linux die with their trainer rank (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from hybridrl.batch import RolloutBatch
from hybridrl.rewards.scoring import (
    Failure,
    Part,
    RewardError,
    RewardTimeoutError,
    score_each,
    score_part,
    unfinished,
)

MIN_START_S = 300.0


def start_timeout_s(timeout_s: float | None) -> float | None:
    """How long workers may take to start (None: no limit, as reward.timeout_s=null)."""
    return None if timeout_s is None else max(timeout_s, MIN_START_S)


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginSpec:
    """What a worker builds its reward manager from."""

    name: str  # reward.name (an installed entry point)
    kwargs: dict[str, Any]  # reward.kwargs
    tokenizer_path: str  # reloaded with AutoTokenizer.from_pretrained
    ctx: dict[str, Any]  # the rest of the plugin's ctx, as is


class WorkerPool:
    kills_on_timeout = True  # a worker past its deadline is killed: timeouts can be survived

    def __init__(self, spec: PluginSpec, *, num_workers: int, timeout_s: float | None, what: str) -> None:
        self.spec, self.timeout_s, self.what = spec, timeout_s, what
        self._ctx = multiprocessing.get_context("spawn")
        self.workers = [_Worker(self._ctx, spec, i) for i in range(num_workers)]  # they start building at once
        atexit.register(self.close)

    def start(self, batch: RolloutBatch, indices: list[int], *, each: bool) -> PoolJob:
        """Send each worker its shard of ``indices`` (after replacing dead workers and waiting for them)."""
        self._ensure_ready()
        tasks: list[tuple[_Worker, list[int]]] = []
        for worker, chunk in zip(self.workers, _split(indices, len(self.workers)), strict=False):
            try:
                worker.conn.send_bytes(pickle.dumps((each, chunk, batch.index(chunk))))
            except OSError:  # it died since the last pass: the job reports it as crashed
                pass
            tasks.append((worker, chunk))
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        return PoolJob(tasks, each=each, deadline=deadline, timeout_s=self.timeout_s)

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        atexit.unregister(self.close)

    def _ensure_ready(self) -> None:
        self.workers = [w if w.alive() else _Worker(self._ctx, self.spec, w.rank) for w in self.workers]
        waiting = [w for w in self.workers if not w.ready]
        limit = start_timeout_s(self.timeout_s)
        deadline = None if limit is None else time.monotonic() + limit
        while waiting:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait([w.conn for w in waiting] + [w.process.sentinel for w in waiting], left):
                self.close()
                raise RewardTimeoutError(f"{self.what}: {len(waiting)} reward worker(s) did not start within {limit} s "
                                         f"(spawn, imports, building the plugin)")
            for w in list(waiting):
                try:
                    message = w.recv() if w.conn.poll() else None
                except (EOFError, OSError):
                    message = None
                if message == ("ready",):
                    w.ready = True
                    waiting.remove(w)
                elif message is not None:  # ("build_error", summary, traceback)
                    self.close()
                    raise RewardError(f"{self.what} could not be built in a reward worker (reward.num_workers="
                                      f"{len(self.workers)}): {message[1]}\n\nTraceback in the worker:\n{message[2]}")
                elif not w.process.is_alive():
                    self.close()
                    raise RewardError(f"{self.what}: a reward worker died while starting "
                                      f"({exit_text(w.process.exitcode)})")


class PoolJob:
    """One pass in flight on the workers; ``wait`` collects their parts until the deadline."""

    def __init__(self, tasks: list[tuple[_Worker, list[int]]], *, each: bool, deadline: float | None,
                 timeout_s: float | None) -> None:
        self.tasks, self.each, self.deadline, self.timeout_s = tasks, each, deadline, timeout_s

    def wait(self) -> list[Part]:
        parts: list[Part] = []
        busy = {w: list(chunk) for w, chunk in self.tasks}  # what each worker still owes, in order
        while busy:
            left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            if not wait([w.conn for w in busy] + [w.process.sentinel for w in busy], left):
                break
            for w, owed in list(busy.items()):
                self._drain(w, owed, parts)
                if owed and not w.process.is_alive():
                    self._drain(w, owed, parts)  # what it sent before it died
                    parts += unfinished(owed, each=self.each, kind="crashed",
                                        summary=f"its reward worker died ({exit_text(w.process.exitcode)})")
                    owed.clear()
                    w.kill()
                if not owed:
                    del busy[w]
        for w, owed in busy.items():  # past the deadline
            parts += unfinished(owed, each=self.each, kind="timeout",
                                summary=f"still running after reward.timeout_s={self.timeout_s} s; worker killed")
            w.kill()
        return parts

    @staticmethod
    def _drain(w: _Worker, owed: list[int], parts: list[Part]) -> None:
        try:
            while owed and w.conn.poll():
                part = w.recv()
                parts.append(part)
                del owed[:len(part.indices)]
        except (EOFError, OSError):  # it died mid-message; the caller sees it dead
            pass


class _Worker:
    def __init__(self, ctx: Any, spec: PluginSpec, rank: int) -> None:
        self.rank, self.ready = rank, False
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, spec, os.getpid()), name=f"hybridrl-reward-{rank}")
        self.process.start()
        child.close()

    def recv(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())

    def alive(self) -> bool:
        return not self.conn.closed and self.process.is_alive()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.conn.close()


def serve(conn: Connection, spec: PluginSpec, parent_pid: int) -> None:
    """A worker's main: build the plugin, say ready, then score each shard it is sent until the pipe closes."""
    _die_with_parent(parent_pid)
    try:
        from transformers import AutoTokenizer

        from hybridrl.registry import Registry

        tokenizer = AutoTokenizer.from_pretrained(spec.tokenizer_path)
        manager = Registry("reward_managers").build(spec.name, spec.kwargs, key="reward.kwargs", tokenizer=tokenizer,
                                                      **spec.ctx)
    except Exception as e:
        conn.send_bytes(pickle.dumps(("build_error", f"{type(e).__name__}: {e}", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready",)))
    while True:
        try:
            each, indices, shard = pickle.loads(conn.recv_bytes())
        except EOFError:  # the trainer closed the pool
            return
        for part in score_each(manager, shard, indices) if each else [score_part(manager, shard, indices)]:
            try:
                data = pickle.dumps(part)
            except Exception as e:
                data = pickle.dumps(Part(indices=part.indices, failure=Failure(
                    kind="raised", summary=f"its output cannot be pickled back from the worker: {type(e).__name__}: "
                                           f"{e}", traceback=traceback.format_exc())))
            conn.send_bytes(data)


def exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _split(indices: list[int], n: int) -> list[list[int]]:
    """``indices`` in at most ``n`` contiguous, non-empty chunks whose sizes differ by at most one."""
    n = min(n, len(indices))
    size, extra = divmod(len(indices), n) if n else (0, 0)
    bounds = [k * size + min(k, extra) for k in range(n + 1)]
    return [indices[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _die_with_parent(parent_pid: int) -> None:
    """A worker never outlives its trainer rank (a hung one would otherwise spin on after the rank is killed)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the rank died before prctl took effect
        os._exit(0)
