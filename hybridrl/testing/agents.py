"""The multi-turn contracts: check_tool and check_environment."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from hybridrl.batch import SampleMeta
from hybridrl.testing.batches import GROUND_TRUTHS
from hybridrl.testing.kit import EXTRA_CTX_KEY, _Plugin, check_plugin_class

_DUMMY = {"string": "1", "integer": 1, "number": 1.0, "boolean": False, "array": [], "object": {}}


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, awaited when it is a coroutine function (tools and episodes may be either)."""
    import asyncio
    import inspect

    out = fn(*args)
    return asyncio.run(out) if inspect.iscoroutine(out) else out


def check_tool(cls: type, *, config: Any = None, arguments: Sequence[Mapping[str, Any]] = (),
               meta: SampleMeta | None = None) -> None:
    """A ``hybridrl.tools`` plugin: ``Config``; built as ``cls(config, **ctx)`` (an unknown ctx key accepted);
    ``schema`` an OpenAI function schema (``{"type": "function", "function": {"name", "description",
    "parameters": {"type": "object", ...}}}``); ``takes_sample``, where set, a bool; called with ``arguments``
    (default: one dict of placeholder values for the schema's required parameters), and ``sample=`` the
    :class:`~hybridrl.interfaces.ToolSample` of ``meta`` (default: a row with a ground truth) where it takes one, it
    returns a ``str`` or a :class:`~hybridrl.interfaces.ToolResult` (text and PIL images), or raises an ``Exception``
    (an error observation); the same call returns the same text (and images)."""
    from hybridrl.interfaces import ToolResult, ToolSample
    from hybridrl.tools.runner import takes_sample

    p = _Plugin(cls, "tools")
    p.expect(isinstance(getattr(cls, "takes_sample", False), bool), "takes_sample",
             f"takes_sample must be True or False, got {getattr(cls, 'takes_sample', None)!r}")
    config = check_plugin_class(cls, "tools", config=config)
    with p.step("build with an unknown ctx key"):
        tool = cls(config, **{EXTRA_CTX_KEY: 1})
    schema = getattr(tool, "schema", None)
    fn = schema.get("function") if isinstance(schema, dict) and schema.get("type") == "function" else None
    p.expect(isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"]), "schema",
             f'expected {{"type": "function", "function": {{"name": ..., ...}}}}, got {schema!r}')
    assert isinstance(fn, dict)
    params = fn.get("parameters")
    p.expect(isinstance(fn.get("description"), str) and isinstance(params, dict) and params.get("type") == "object",
             "schema", "function needs a description and parameters of type object (JSON Schema)")
    assert isinstance(params, dict)
    if not arguments:
        props = params.get("properties", {})
        arguments = [{k: _DUMMY.get(props.get(k, {}).get("type"), "1") for k in params.get("required", [])}]
    sample: dict[str, Any] = {}
    if takes_sample(tool):
        sample = {"sample": ToolSample.of(meta if meta is not None else SampleMeta(ground_truth=GROUND_TRUTHS[0]),
                                          fn["name"])}
    for args in arguments:
        outs = []
        for _ in range(2):
            try:
                out = _run(partial(tool, dict(args), **sample))
                if isinstance(out, ToolResult) and isinstance(out.text, str):  # its text and images, compared
                    out = out.text + "".join(f"\n<image {im.size} {hash(im.tobytes())}>" for im in out.images)
                outs.append(out)
            except Exception as e:  # an error observation: allowed
                outs.append(f"raised {type(e).__name__}: {e}")
        p.expect(all(isinstance(o, str) for o in outs), "returns str",
                 f"called with {dict(args)!r} it returned {type(outs[0]).__name__}: the policy reads text (or a "
                 "ToolResult's text and images)")
        p.expect(outs[0] == outs[1], "same call, same text", f"{dict(args)!r} gave {outs[0]!r}, then {outs[1]!r}")


def check_environment(cls: type, *, config: Any = None, meta: SampleMeta | None = None,
                      replies: Sequence[str] = ("3", "4", "5", "6")) -> None:
    """A ``hybridrl.environments`` plugin: ``Config``; built as ``cls(config, **ctx)``; ``open(meta, seed=...)``
    gives an episode whose ``step`` answers each assistant message of ``replies`` with an ``EnvStep`` (chat
    messages with str role and content, bool ``done``, float-or-None ``reward``) until ``done``; the same seed
    gives the same steps."""
    from hybridrl.interfaces import EnvStep

    p = _Plugin(cls, "environments")
    config = check_plugin_class(cls, "environments", config=config)
    with p.step("build with an unknown ctx key"):
        env = cls(config, **{EXTRA_CTX_KEY: 1})
    meta = meta if meta is not None else SampleMeta(  # a sample as a multi-turn rollout has it: a chat prompt
        ground_truth=GROUND_TRUTHS[0], data_source="arithmetic",
        messages=[{"role": "user", "content": f"What is {int(GROUND_TRUTHS[0]) - 1}+1?"}])

    def play() -> list[EnvStep]:
        with p.step("open and step an episode"):
            episode, steps = env.open(meta, seed=7), []
            for reply in replies:
                steps.append(_run(episode.step, {"role": "assistant", "content": reply}))
                if not isinstance(steps[-1], EnvStep) or steps[-1].done:
                    break
            if callable(getattr(episode, "close", None)):
                _run(episode.close)
        return steps

    steps = play()
    for s in steps:
        p.expect(isinstance(s, EnvStep), "step returns EnvStep", f"got {type(s).__name__}")
        p.expect(isinstance(s.done, bool) and (s.reward is None or isinstance(s.reward, (int, float))),
                 "EnvStep fields", f"done={s.done!r}, reward={s.reward!r}")
        p.expect(all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                     for m in s.messages), "EnvStep.messages", f"chat messages with str role/content: {s.messages!r}")
    p.expect(steps == play(), "same seed, same steps", "two episodes opened with seed 7 differ")
