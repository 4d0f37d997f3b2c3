"""``actor_rollout_ref.rollout.multi_turn``: tool-calling, multi-turn rollouts (verl's key names where verl has one).

One response budget over all turns: ``data.max_response_length`` tokens, sampled and appended together. A turn
with tool calls runs the tools and goes on; a turn without calls goes to the environment (if any) or ends the
episode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridrl.tools.calls import FORMATS

KEY = "actor_rollout_ref.rollout.multi_turn"
# what picks a tool or an environment: refused while enable is false (the plugin would never run: an agent
# environment's every reward 0); the turn limits, timeouts and format are harmless then (a multi-turn recipe run with
# enable=false keeps them)
PLUGIN_CHOICES = ("tools", "tool_kwargs", "environment", "environment_kwargs")


@dataclass(kw_only=True, slots=True)
class MultiTurnConfig:
    enable: bool = False
    max_assistant_turns: int = 4  # policy turns per episode at most
    tools: list[str] = field(default_factory=list)  # tool plugin names (group hybridrl.tools)
    # tool name -> its Config's keys; an installed tool's that is not in `tools` are dropped
    # (hybridrl/config/plugin_kwargs.py)
    tool_kwargs: dict[str, Any] = field(default_factory=dict)
    environment: str | None = None  # environment plugin name (group hybridrl.environments)
    # the environment's Config: flat keys (the chosen environment's), or <environment name>: {keys} blocks, each used
    # only when that environment is chosen (hybridrl/config/plugin_kwargs.py)
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_timeout_s: float = 10.0  # one tool call; past it the call is an error observation
    # one environment open() or step() (close() too, past which it is only warned of); past it the episode ends failed
    environment_timeout_s: float = 60.0
    max_tool_response_length: int = 256  # tokens of a tool's output; longer is cut (and counted)
    format: str = "hermes"  # one of hybridrl.tools.calls.FORMATS


def config_problems(m: MultiTurnConfig, *, load_tool: Callable[[str], type],
                    check_kwargs: Callable[[str, str, dict[str, Any], str], None],
                    environments: Callable[[str], type]) -> list[tuple[str, object, str]]:
    """``(key, value, message)`` for every problem of ``multi_turn``. ``load_tool(name)`` / ``environments(name)``
    return the plugin class or raise naming the installed ones; ``check_kwargs(group, name, kwargs, key)`` raises
    when a plugin's kwargs do not fit its Config. While ``enable`` is false a tool or environment chosen is a problem
    (nothing would run it), and the plugins are not loaded."""
    out: list[tuple[str, object, str]] = []
    if m.max_assistant_turns < 1:
        out.append((f"{KEY}.max_assistant_turns", m.max_assistant_turns, "must be ≥ 1"))
    for name in ("tool_timeout_s", "environment_timeout_s"):
        if not getattr(m, name) > 0:
            out.append((f"{KEY}.{name}", getattr(m, name), "must be > 0 (seconds)"))
    if m.max_tool_response_length < 1:
        out.append((f"{KEY}.max_tool_response_length", m.max_tool_response_length, "must be ≥ 1 (tokens)"))
    if m.format not in FORMATS:
        out.append((f"{KEY}.format", m.format, f"valid: {', '.join(FORMATS)}"))
    if extra := sorted(set(m.tool_kwargs) - set(m.tools)):  # an installed tool's are dropped when it is not listed
        out.append((f"{KEY}.tool_kwargs", extra, f"names tools that are not in {KEY}.tools={m.tools}"))
    if not m.enable:  # a plugin chosen for a rollout that is off; its limits and format may stay as a recipe set them
        default = MultiTurnConfig()
        unused = [f"{KEY}.{name}={getattr(m, name)!r}" for name in PLUGIN_CHOICES
                  if getattr(m, name) != getattr(default, name)]
        if unused:
            one = len(unused) == 1
            out.append((f"{KEY}.enable", False, f"but {', '.join(unused)} {'is a setting' if one else 'are settings'} "
                        "of the multi-turn rollout, which is off (no tool or environment would run; their rewards "
                        f"would be 0): set {KEY}.enable=true, or drop {'it' if one else 'them'}"))
        return out
    called: dict[str, str] = {}  # the name the policy calls -> the tool plugin
    for i, name in enumerate(m.tools):
        if name in m.tools[:i]:
            out.append((f"{KEY}.tools", m.tools, f"{name!r} is listed twice"))
            continue
        try:
            cls = load_tool(name)
        except Exception as e:  # the registry's errors name the key and the installed plugins
            out.append((f"{KEY}.tools", name, str(e)))
            continue
        fn = (getattr(cls, "schema", None) or {}).get("function", {}).get("name")
        if fn in called:
            out.append((f"{KEY}.tools", name, f"calls itself {fn!r}, as {called[fn]!r} does: the policy calls a "
                        "tool by its schema's name, so two tools cannot share one"))
        called.setdefault(fn, name)
        try:
            check_kwargs("tools", name, dict(m.tool_kwargs.get(name) or {}), f"{KEY}.tool_kwargs.{name}")
        except Exception as e:
            out.append((f"{KEY}.tool_kwargs.{name}", dict(m.tool_kwargs.get(name) or {}), str(e)))
    if m.environment is not None:
        try:
            environments(m.environment)
            check_kwargs("environments", m.environment, dict(m.environment_kwargs), f"{KEY}.environment_kwargs")
        except Exception as e:
            out.append((f"{KEY}.environment", m.environment, str(e)))
    return out
