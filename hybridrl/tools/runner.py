"""Running one turn's tool calls: concurrently, each within ``multi_turn.tool_timeout_s``, and never raising.

Every call gets an observation, the text the policy reads next (a tool message), cut to
``max_tool_response_length`` tokens: the tool's output, or an error text for a call that could not be read
(:class:`CallError`), names an unknown tool, raises, or runs past its time limit. The counts are the step's
``multi_turn/tool_*`` metrics. The calls of one turn (and of all episodes handed in together) run at once, at most
``max_workers`` at a time, each limit counted from its own start (:mod:`hybridrl.tools.bounded`); a coroutine tool
runs in its own event loop. A call past its limit gives its worker back at once (a coroutine is cancelled, a
synchronous call abandoned), so a tool that never returns costs each round of calls its timeout and never stalls
the run; :mod:`hybridrl.tools.bounded` says what bounds the abandoned calls.

A tool that sets ``takes_sample = True`` (:class:`~hybridrl.interfaces.Tool`) gets each call's sample as well:
``tool(arguments, sample=ToolSample)``, from the ``metas`` (and the episode's ``images`` so far) handed in with the
calls (the episode each call belongs to); any other tool is called with the arguments alone.

A tool may return a :class:`~hybridrl.interfaces.ToolResult`: its text is the observation (cut as above) and its
images travel with it (``Observation.images``, PIL RGB); a runner built with ``images=False`` (a text policy) answers
a result with images with an error observation, since the policy could not see them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from hybridrl.interfaces import ToolResult, ToolSample
from hybridrl.tools.bounded import Bounded
from hybridrl.tools.calls import CallError, ToolCall
from hybridrl.tools.config import KEY

if TYPE_CHECKING:
    from hybridrl.batch import SampleMeta

ERROR_PREFIX = "Error: "


@dataclass(slots=True, kw_only=True)
class Observation:
    text: str  # the tool message's content (its text part where there are images)
    images: list[Any] = field(default_factory=list)  # PIL images (RGB) the tool message shows before its text
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
                 max_tokens: int, cut: Callable[[str, int], tuple[str, bool]], max_workers: int = 32,
                 images: bool = False) -> None:
        self.tools, self.timeout_s, self.max_tokens, self.cut = dict(tools), timeout_s, max_tokens, cut
        self.images = images  # a vision-language policy: tool results may carry images
        self.bounded = Bounded(key=f"{KEY}.tool_timeout_s", max_workers=max_workers)
        self.counts = ToolCounts()

    def run(self, calls: Sequence[ToolCall | CallError], *, metas: Sequence[SampleMeta] | None = None,
            images: Sequence[Sequence[Any]] | None = None) -> list[Observation]:
        """An observation per call, in order; the calls run at once, each within its own time limit. ``metas``: the
        sample each call serves (for the tools that take it); ``images``: each call's episode's images so far (None:
        its prompt's)."""
        out: list[Observation | None] = [None] * len(calls)
        started: list[tuple[int, str]] = []
        for i, call in enumerate(calls):
            if isinstance(call, CallError):
                out[i] = _error(f"the tool call could not be read: {call.message}")
            elif call.name not in self.tools:
                out[i] = _error(f"unknown tool {call.name!r}; the tools are: {', '.join(sorted(self.tools))}")
            elif metas is None and takes_sample(self.tools[call.name]):
                out[i] = _error(f"tool {call.name!r} needs the sample it serves, and this rollout gave none")
            else:
                started.append((i, call.name))
        work = [self._call(name, calls[i].arguments, None if metas is None else metas[i],  # type: ignore[union-attr]
                           None if images is None else images[i]) for i, name in started]
        outcomes = self.bounded.run(work, timeout_s=self.timeout_s, names=[f"tool {name!r}" for _, name in started])
        for (i, name), o in zip(started, outcomes, strict=True):
            if o.timed_out:
                out[i] = Observation(text=f"{ERROR_PREFIX}tool {name!r} took longer than {self.timeout_s:g} s",
                                     error=True, timed_out=True)
            elif o.error is not None:
                out[i] = _error(f"tool {name!r} raised {type(o.error).__name__}: {o.error}")
            else:
                out[i] = self._observation(name, o.value)
        done = [self._cut(o) for o in out if o is not None]
        for obs in done:
            self.counts.add(obs)
        return done

    def _call(self, name: str, arguments: dict[str, Any], meta: SampleMeta | None,
              images: Sequence[Any] | None) -> Callable[[], Any]:
        """The call of tool ``name``: with its sample where the tool takes one."""
        tool = self.tools[name]
        if meta is not None and takes_sample(tool):
            return partial(tool, dict(arguments), sample=ToolSample.of(meta, name, images=images))
        return partial(tool, dict(arguments))

    def _observation(self, name: str, value: Any) -> Observation:
        """What tool ``name`` returned, as an observation: text, or a :class:`ToolResult`'s text and images."""
        if isinstance(value, str):
            return Observation(text=value)
        if not isinstance(value, ToolResult) or not isinstance(value.text, str):
            return _error(f"tool {name!r} returned {type(value).__name__}, not text")  # nor a ToolResult
        from PIL import Image

        images = list(value.images)
        if bad := [type(im).__name__ for im in images if not isinstance(im, Image.Image)]:
            return _error(f"tool {name!r} returned images that are not PIL images: {bad[:3]}")
        if images and not self.images:
            return _error(f"tool {name!r} returned {len(images)} image(s), which this policy cannot see (a text "
                          "model); use a vision-language model (Qwen2.5-VL, Qwen3-VL)")
        return Observation(text=value.text, images=[im.convert("RGB") for im in images])

    def _cut(self, obs: Observation) -> Observation:
        """Every observation, an error's too (a tool's exception may carry any text), at most ``max_tokens``."""
        text, cut = self.cut(obs.text, self.max_tokens)
        obs.text, obs.truncated = text, cut
        return obs

    def take_counts(self) -> ToolCounts:
        """The counts since the last call (a step's), reset."""
        counts, self.counts = self.counts, ToolCounts()
        return counts


def takes_sample(tool: Any) -> bool:
    """Whether ``tool`` asked for the sample each call serves (``takes_sample = True``)."""
    return getattr(tool, "takes_sample", False) is True


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
