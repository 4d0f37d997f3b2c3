"""One turn's tool calls (``hybridrl.tools.runner``): run at once, each within ``tool_timeout_s``; every fault is an
error observation for the policy and a count, never an exception in the trainer."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from hybridrl.models.char_tokenizer import make_char_tokenizer
from hybridrl.tools.calculator import Calculator
from hybridrl.tools.calls import parse_calls
from hybridrl.tools.runner import ToolRunner, tokenizer_cut

TIMEOUT = 0.5
MARGIN = 0.5  # thread hand-off on a loaded 2-core machine


def _raises(arguments: dict[str, Any]) -> str:
    raise RuntimeError("disk full")


def _sleeps(arguments: dict[str, Any]) -> str:
    time.sleep(5)  # a daemon thread: abandoned at the limit, it holds nothing up
    return "late"


async def _async_echo(arguments: dict[str, Any]) -> str:
    return "async " + str(arguments.get("x"))


@pytest.fixture
def runner() -> ToolRunner:
    tools = {"calculator": Calculator(), "raises": _raises, "sleeps": _sleeps, "echo": _async_echo,
             "long": lambda a: "x" * 300, "number": lambda a: 42, "shouts": _shouts}
    cut = tokenizer_cut(make_char_tokenizer(model_max_length=512))
    return ToolRunner(tools, timeout_s=TIMEOUT, max_tokens=100, cut=cut)


def _shouts(arguments: dict[str, Any]) -> str:
    raise ValueError("no! " * 100)


def _turn(*calls: str) -> list[Any]:
    return parse_calls("".join(f"<tool_call>{c}</tool_call>" for c in calls))


def test_every_fault_is_an_observation_and_a_count(runner: ToolRunner) -> None:
    t0 = time.monotonic()
    obs = runner.run(_turn('{"name": "calculator", "arguments": {"expression": "6*7"}}', "{not json",
                           '{"name": "search", "arguments": {}}', '{"name": "calculator", "arguments": {"expr": 1}}',
                           '{"name": "raises", "arguments": {}}', '{"name": "sleeps", "arguments": {}}',
                           '{"name": "long", "arguments": {}}', '{"name": "echo", "arguments": {"x": 1}}',
                           '{"name": "number", "arguments": {}}', '{"name": "shouts", "arguments": {}}'))
    took = time.monotonic() - t0
    assert took < TIMEOUT + MARGIN  # the stuck tool is answered at its limit, not awaited
    texts = [o.text for o in obs]
    assert texts[0] == "42"
    assert texts[1].startswith("Error: the tool call could not be read: not JSON")
    assert texts[2] == ("Error: unknown tool 'search'; the tools are: calculator, echo, long, number, raises, shouts, "
                        "sleeps")
    assert texts[3].startswith("Error: tool 'calculator' raised ValueError: calculator takes")
    assert texts[4] == "Error: tool 'raises' raised RuntimeError: disk full"
    assert texts[5] == f"Error: tool 'sleeps' took longer than {TIMEOUT:g} s" and obs[5].timed_out
    assert texts[6] == "x" * 100 + " [truncated]" and obs[6].truncated and not obs[6].error
    assert texts[7] == "async 1"
    assert texts[8] == "Error: tool 'number' returned int, not text"
    # an error's text is cut like any output: an exception may carry any amount of text
    assert texts[9].startswith("Error: tool 'shouts' raised ValueError: no! no!") and obs[9].error and obs[9].truncated
    assert len(texts[9].removesuffix(" [truncated]")) == 100
    counts = runner.take_counts()
    assert [i for i, o in enumerate(obs) if o.truncated] == [1, 3, 6, 9]  # 1, 3: long error texts
    assert (counts.calls, counts.errors, counts.timeouts, counts.truncated) == (10, 7, 1, 4)
    assert runner.take_counts().calls == 0  # per step


def test_the_calls_of_a_turn_run_at_once() -> None:
    barrier = threading.Barrier(3, timeout=5)  # passes only if all three calls run together

    def meet(arguments: dict[str, Any]) -> str:
        barrier.wait()
        return "met"

    r = ToolRunner({"meet": meet}, timeout_s=10, max_tokens=10, cut=lambda t, n: (t, False))
    assert [o.text for o in r.run(_turn(*['{"name": "meet", "arguments": {}}'] * 3))] == ["met"] * 3


def test_a_call_queued_behind_others_keeps_its_whole_time_limit() -> None:
    """With more calls than workers, each call's limit counts from when it starts running, not from the batch's
    start: 3 calls of 0.6 s on 1 worker under a 1 s limit all finish (one at a time: ~1.8 s), none times out."""
    def slow(arguments: dict[str, Any]) -> str:
        time.sleep(0.6)
        return "done"

    cut = tokenizer_cut(make_char_tokenizer(model_max_length=512))
    runner = ToolRunner({"slow": slow}, timeout_s=1.0, max_tokens=10, cut=cut, max_workers=1)
    t0 = time.monotonic()
    obs = runner.run(_turn(*['{"name": "slow", "arguments": {}}'] * 3))
    assert [o.text for o in obs] == ["done"] * 3 and 1.7 < time.monotonic() - t0 < 1.7 + MARGIN
