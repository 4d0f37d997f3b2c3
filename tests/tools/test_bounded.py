"""Calls past their limit give their worker back (``hybridrl.tools.bounded``): more hung calls than workers never
stall later calls; a hung coroutine is cancelled; abandoned threads are capped with an error naming the key."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hybridrl.batch import SampleMeta
from hybridrl.interfaces import EnvStep, SamplingParams
from hybridrl.rollout.episodes import EpisodeActors, OwnedTurn
from hybridrl.tools import bounded
from hybridrl.tools.bounded import Bounded, StuckCallsError
from hybridrl.tools.calls import parse_calls
from hybridrl.tools.runner import ToolRunner

TIMEOUT = 0.3
MARGIN = 0.5  # thread hand-off on a loaded 2-core machine
KEY = "actor_rollout_ref.rollout.multi_turn.tool_timeout_s"


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end of a test: its hung calls return, their threads end, this process's stuck count is 0 again."""
    event = threading.Event()
    yield event
    event.set()
    deadline = time.monotonic() + 5
    while bounded.stuck() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bounded.stuck() == {}


def test_more_hung_calls_than_workers_each_time_out_at_its_limit_and_later_calls_run(release: threading.Event) -> None:
    """7 calls that never return on 2 workers: each is answered as timed out ~TIMEOUT after it started (4 waves:
    its slot comes back when it is abandoned), then a call runs at once although all 7 threads still hang."""
    pool = Bounded(key=KEY, max_workers=2)
    t0 = time.monotonic()
    out = pool.run([release.wait] * 7, timeout_s=TIMEOUT, names=["tool 'hang'"] * 7)
    took = time.monotonic() - t0
    assert [o.timed_out for o in out] == [True] * 7
    assert 4 * TIMEOUT <= took < 4 * TIMEOUT + MARGIN, took
    assert bounded.stuck() == {f"tool 'hang' ({KEY}={TIMEOUT:g})": 7}
    t0 = time.monotonic()
    assert [o.value for o in pool.run([lambda: "ok"] * 3, timeout_s=TIMEOUT)] == ["ok"] * 3
    assert time.monotonic() - t0 < MARGIN


def test_the_runner_answers_every_hung_call_and_counts_it(release: threading.Event) -> None:
    def hang(arguments: dict[str, Any]) -> str:
        release.wait()
        return "late"

    runner = ToolRunner({"hang": hang, "echo": lambda a: "echo"}, timeout_s=TIMEOUT, max_tokens=50,
                        cut=lambda t, n: (t, False), max_workers=2)
    for _ in range(3):  # 12 hung calls in all, 2 workers: no turn waits on an earlier turn's calls
        t0 = time.monotonic()
        obs = runner.run(parse_calls('<tool_call>{"name": "hang", "arguments": {}}</tool_call>' * 4
                                     + '<tool_call>{"name": "echo", "arguments": {}}</tool_call>'))
        assert time.monotonic() - t0 < 3 * TIMEOUT + MARGIN  # ceil(5 / 2) waves at most
        assert [o.text for o in obs] == [f"Error: tool 'hang' took longer than {TIMEOUT:g} s"] * 4 + ["echo"]
    counts = runner.take_counts()
    assert (counts.calls, counts.timeouts, counts.errors) == (15, 12, 12)


def test_a_hung_coroutine_is_cancelled_and_its_thread_ends() -> None:
    cancelled = threading.Event()

    async def hang() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    out = Bounded(key=KEY, max_workers=1).run([hang, hang], timeout_s=TIMEOUT, names=["tool 'async'"] * 2)
    assert [o.timed_out for o in out] == [True, True]
    assert cancelled.wait(2)
    deadline = time.monotonic() + 2
    while bounded.stuck() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bounded.stuck() == {}


def test_abandoned_calls_past_the_cap_stop_the_run_naming_the_key_and_the_tool(
        release: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounded, "MAX_STUCK", 3)
    pool = Bounded(key=KEY, max_workers=8)
    assert all(o.timed_out for o in pool.run([release.wait] * 3, timeout_s=TIMEOUT, names=["tool 'hang'"] * 3))
    ran = []
    with pytest.raises(StuckCallsError) as e:
        pool.run([lambda: ran.append(1)], timeout_s=TIMEOUT, names=["tool 'echo'"])
    assert ran == []
    assert str(e.value).startswith("3 calls past their time limit still run in abandoned threads (tool 'hang' "
                                   f"({KEY}={TIMEOUT:g}): 3)")
    assert f"({KEY}={TIMEOUT:g}): give its blocking I/O a timeout" in str(e.value)
    release.set()  # the hung calls return at last: they stop counting, calls run again
    deadline = time.monotonic() + 2
    while bounded.stuck() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [o.value for o in pool.run([lambda: "ok"], timeout_s=TIMEOUT)] == ["ok"]


class _HangingEnv:
    """``open()`` of sample 0 and ``close()`` of every episode never return; steps answer at once."""

    Config = dict

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def open(self, meta: SampleMeta, *, seed: int) -> Any:
        if seed == 0:
            self.release.wait()
        return self

    def step(self, message: dict[str, Any]) -> EnvStep:
        return EnvStep(messages=[{"role": "user", "content": "again"}], done=False)

    def close(self) -> None:
        self.release.wait()


def test_an_environment_that_hangs_in_open_or_close_costs_its_timeout(release: threading.Event) -> None:
    actors = EpisodeActors(None, ToolRunner({}, timeout_s=1, max_tokens=1, cut=lambda t, n: (t, False)),  # type: ignore[arg-type]
                           format="hermes", environment=_HangingEnv(release), environment_timeout_s=TIMEOUT,
                           max_assistant_turns=3)
    meta = SampleMeta(messages=[{"role": "user", "content": "hi"}])
    for s in range(3):
        actors.open(s, meta)
    t0 = time.monotonic()
    out = actors._env_steps([(OwnedTurn(sample=s, ids=[], logprobs=[], cut=False, turns=1, meta=meta, seed=s,
                                        context_tokens=0, params=SamplingParams()), "answer") for s in range(3)])
    env_key = "actor_rollout_ref.rollout.multi_turn.environment_timeout_s"
    assert out[0].error == f"open() took longer than {env_key}={TIMEOUT:g} s"  # type: ignore[union-attr]
    assert all(isinstance(o, EnvStep) for o in out[1:])
    actors.close_all()  # two close() calls that never return
    assert time.monotonic() - t0 < 2 * TIMEOUT + MARGIN
    assert actors.owned == {}
