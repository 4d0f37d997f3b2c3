"""Running one turn's tool calls: concurrently, each within ``multi_turn.tool_timeout_s``, and never raising.

Every call gets an observation, the text the policy reads next (a tool message): the tool's output, cut to
``max_tool_response_length`` tokens, or an error text for a call that could not be read (:class:`CallError`), names
an unknown tool, raises, or runs past its time limit. The counts are the step's ``multi_turn/tool_*`` metrics.

Calls of one turn (and of all episodes handed in together) each run in a daemon thread, at most ``max_workers`` at
a time; a coroutine tool runs in its own event loop there. A call past its limit is answered with a timeout
observation at once; its thread is abandoned (Python cannot stop a thread), keeps its slot until it returns and
never holds up the process's exit (a daemon), so a tool that can hang for good should run its work in a
subprocess it can kill.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from hybridrl.tools.calls import CallError, ToolCall

ERROR_PREFIX = "Error: "


@dataclass(slots=True, kw_only=True)
class Observation:
    text: str  # the tool message's content
    error: bool = False  # an error observation (malformed call, unknown tool, raised, timed out)
    timed_out: bool = False
    truncated: bool = False


@dataclass(slots=True, kw_only=True)
class ToolCounts:
    calls: int = 0
    errors: int = 0  # timeouts included
    timeouts: int = 0
    truncated: int = 0

    def add(self, obs: Observation) -> None:
        self.calls += 1
        self.errors += obs.error
        self.timeouts += obs.timed_out
        self.truncated += obs.truncated


class ToolRunner:
    """``tools``: the policy's name for each tool (its ``schema["function"]["name"]``) → the built tool.
    ``cut(text, n)`` returns ``text`` cut to ``n`` tokens and whether it was cut (the policy's tokenizer)."""

    def __init__(self, tools: Mapping[str, Callable[[dict[str, Any]], Any]], *, timeout_s: float,
                 max_tokens: int, cut: Callable[[str, int], tuple[str, bool]], max_workers: int = 8) -> None:
        self.tools, self.timeout_s, self.max_tokens, self.cut = dict(tools), timeout_s, max_tokens, cut
        self.slots = threading.BoundedSemaphore(max_workers)
        self.counts = ToolCounts()

    def run(self, calls: Sequence[ToolCall | CallError]) -> list[Observation]:
        """An observation per call, in order; the calls run at once, each within its own time limit."""
        futures: dict[int, Future[Any]] = {}
        out: list[Observation | None] = [None] * len(calls)
        for i, call in enumerate(calls):
            if isinstance(call, CallError):
                out[i] = _error(f"the tool call could not be read: {call.message}")
            elif call.name not in self.tools:
                out[i] = _error(f"unknown tool {call.name!r}; the tools are: {', '.join(sorted(self.tools))}")
            else:
                futures[i] = self._start(self.tools[call.name], dict(call.arguments))
        deadline = time.monotonic() + self.timeout_s
        pending = set(futures.values())
        while pending and (left := deadline - time.monotonic()) > 0:
            _, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
        for i, future in futures.items():
            name = calls[i].name  # type: ignore[union-attr]
            if not future.done():
                future.cancel()
                out[i] = Observation(text=f"{ERROR_PREFIX}tool {name!r} took longer than {self.timeout_s:g} s",
                                     error=True, timed_out=True)
            elif (e := future.exception()) is not None:
                out[i] = _error(f"tool {name!r} raised {type(e).__name__}: {e}")
            elif not isinstance(result := future.result(), str):
                out[i] = _error(f"tool {name!r} returned {type(result).__name__}, not text")
            else:
                text, cut = self.cut(result, self.max_tokens)
                out[i] = Observation(text=text, truncated=cut)
        done = [o for o in out if o is not None]
        for obs in done:
            self.counts.add(obs)
        return done

    def _start(self, tool: Callable[[dict[str, Any]], Any], arguments: dict[str, Any]) -> Future[Any]:
        future: Future[Any] = Future()

        def work() -> None:
            with self.slots:
                if not future.set_running_or_notify_cancel():  # answered as timed out while it waited
                    return
                try:
                    future.set_result(_call(tool, arguments))
                except BaseException as e:  # noqa: BLE001  (SystemExit of a tool is its error too)
                    future.set_exception(e)

        threading.Thread(target=work, daemon=True, name="hybridrl-tool").start()
        return future

    def take_counts(self) -> ToolCounts:
        """The counts since the last call (a step's), reset."""
        counts, self.counts = self.counts, ToolCounts()
        return counts



def _call(tool: Callable[[dict[str, Any]], Any], arguments: dict[str, Any]) -> Any:
    result = tool(arguments)
    return asyncio.run(result) if inspect.iscoroutine(result) else result  # a coroutine tool: its own loop


def _error(message: str) -> Observation:
    return Observation(text=ERROR_PREFIX + message, error=True)


def tokenizer_cut(tokenizer: Any) -> Callable[[str, int], tuple[str, bool]]:
    """``cut`` for :class:`ToolRunner`: ``text`` cut to its first ``n`` tokens of ``tokenizer``, marked as cut."""

    def cut(text: str, n: int) -> tuple[str, bool]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= n:
            return text, False
        return tokenizer.decode(ids[:n]) + " [truncated]", True

    return cut
