"""verl's tool YAML (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) read as hybridrl's tool plugins.

verl's file lists its tools as ``tools: [{class_name, config: {type: native, ...}, tool_schema: {type: function,
function: {name, description, parameters}}}]``; verl imports ``class_name`` and builds it with ``config`` and
``tool_schema``. Here each entry becomes a tool plugin (group ``hybridrl.tools``) in ``multi_turn.tools``, and its
``config`` (less verl's ``type``) that plugin's ``multi_turn.tool_kwargs.<tool>``, checked by the plugin's Config:

- ``class_name`` names a hybridrl tool plugin, by its entry-point name (``calculator``) or by its class's import path
  (``hybridrl.tools.calculator.Calculator``): that tool, ``config`` its Config's keys;
- a verl built-in with a hybridrl tool of the same meaning (:data:`VERL_BUILTINS`): verl's sandbox-fusion code tool is
  ``python`` (the policy's code run in a local sandbox; verl's run-time and memory limits carried over, the sandbox
  server's URL and rate limits not used); verl's ``Gsm8kTool`` is ``gsm8k`` (the answer checked against the row's
  ground truth, from the row's ``extra_info.tools_kwargs`` as verl reads it: :mod:`hybridrl.tools.gsm8k`);
- any other class is refused naming it, the file and the installed tools; so is verl's ``type: mcp``.

The schema the policy reads is the plugin's (a plugin cannot be renamed): an entry's ``tool_schema`` whose function
name or parameters differ from it is refused naming the difference; another description is a notice. A relative
path is read from the working directory, as verl reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config.errors import ConfigIssue
from hybridrl.config.schema import RLConfig
from hybridrl.config.verl_keys import AOR
from hybridrl.registry import PluginError, Registry, make_plugin_config
from hybridrl.tools.config import KEY as MULTI_TURN

KEY = f"{AOR}.rollout.multi_turn.tool_config_path"
Applied = tuple[list[str], list[ConfigIssue]]  # notices, issues


def _sandbox_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """verl's sandbox-fusion limits as the python tool's: the run time (wall and CPU) and the memory."""
    out: dict[str, Any] = {}
    if (t := config.get("default_timeout")) is not None:  # not a number: the plugin's Config names it
        number = isinstance(t, int | float) and not isinstance(t, bool)
        out |= {"timeout_s": float(t), "cpu_time_s": max(1, math.ceil(t))} if number else {"timeout_s": t}
    if (mb := config.get("memory_limit_mb")) is not None:
        out["memory_mb"] = mb
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class VerlTool:
    """A verl built-in tool class and what it is here."""

    tool: str  # the hybridrl tool plugin of the same meaning
    kwargs: Callable[[dict[str, Any]], dict[str, Any]] = lambda config: {}  # verl's config → the plugin's
    used: tuple[str, ...] = ()  # verl's config keys that kwargs reads
    allowed: dict[str, tuple[object, ...]] = field(default_factory=dict)  # verl config key → the values that fit
    note: str = ""


_SANDBOX = VerlTool(tool="python", kwargs=_sandbox_kwargs, used=("default_timeout", "memory_limit_mb"),
                    allowed={"default_language": ("python",)},
                    note="the code runs in hybridrl's local sandbox, not on a Sandbox Fusion server")
VERL_BUILTINS: dict[str, VerlTool] = {
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": _SANDBOX,
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": VerlTool(
        tool="image_zoom_in", used=(), note="the crop of the sample's own image, a small one resized up rather than "
        "its box grown; no Ray worker pool or rate limit"),
    "verl.tools.gsm8k_tool.Gsm8kTool": VerlTool(tool="gsm8k", note=(
        "the answer checked against the row's extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth, "
        "else its data.ground_truth_key; the tool replies, reward.name scores")),
}


def tool_config(cfg: RLConfig, values: dict[str, Any]) -> Applied:
    """Read the file at ``tool_config_path`` into ``multi_turn.tools`` / ``tool_kwargs`` (with the tools and kwargs the
    recipe and command line give, which must agree with it)."""
    path = values.get(KEY)
    if path is None or path == "":  # verl's default: no tools
        return [], []
    entries, problem = _read(str(path))
    if problem is not None:
        return [], [ConfigIssue(key=KEY, value=path, message=problem)]
    registry = Registry("tools")
    by_class = _class_paths(registry)
    chosen: dict[str, tuple[int, dict[str, Any]]] = {}  # tool → (its entry's index, its kwargs)
    notices: list[str] = []
    issues: list[ConfigIssue] = []
    for i, entry in enumerate(entries):
        where = f"tools[{i}]"
        mapped = _entry(entry, where, registry, by_class)
        if isinstance(mapped, str):
            issues.append(ConfigIssue(key=KEY, value=path, message=mapped))
            continue
        tool, kwargs, notes = mapped
        if tool in chosen:
            issues.append(ConfigIssue(key=KEY, value=path, message=(
                f"tools[{chosen[tool][0]}] and tools[{i}] are both hybridrl's {tool} tool: list it once")))
            continue
        chosen[tool] = (i, kwargs)
        notices += notes
    m = cfg.actor_rollout_ref.rollout.multi_turn
    for tool, (_, kwargs) in chosen.items():
        given = dict(m.tool_kwargs.get(tool) or {})
        for k, v in kwargs.items():
            if k in given and given[k] != v:
                issues.append(ConfigIssue(key=KEY, value=path, message=(
                    f"sets {tool}'s {k}={v!r}, and {MULTI_TURN}.tool_kwargs.{tool}.{k}={given[k]!r}: set one")))
    if issues:
        return [], issues
    for tool, (_, kwargs) in chosen.items():
        if tool not in m.tools:
            m.tools.append(tool)
        if kwargs:
            m.tool_kwargs[tool] = {**dict(m.tool_kwargs.get(tool) or {}), **kwargs}
        if (t := kwargs.get("timeout_s")) is not None and t >= m.tool_timeout_s:
            notices.append(f"{tool}'s timeout_s={t:g} from the file: {MULTI_TURN}.tool_timeout_s={m.tool_timeout_s:g} "
                           f"ends each call first; raise it past {t:g} for verl's limit")
    said = ", ".join(f"{t} {k}" if k else t for t, (_, k) in chosen.items())
    return [f"verl's {KEY}={path} is hybridrl's {MULTI_TURN}.tools={m.tools} (from the file: {said or 'none'})",
            *notices], []


def _read(path: str) -> tuple[list[Any], str | None]:
    """The file's ``tools`` list, or why it cannot be read."""
    file = Path(path)
    if not file.is_file():
        return [], (f"verl's tool YAML {file.resolve()} does not exist (a relative path is read from the working "
                    f"directory, {Path.cwd()})")
    try:
        node = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except (OSError, yaml.YAMLError, OmegaConfBaseException, ValueError) as e:
        return [], f"verl's tool YAML {path} cannot be read: {' '.join(str(e).split())}"
    tools = node.get("tools") if isinstance(node, dict) else None
    if not isinstance(tools, list):
        return [], f"{path} is not a verl tool YAML: it has no `tools:` list of {{class_name, config, tool_schema}}"
    return tools, None


def _class_paths(registry: Registry) -> dict[str, str]:
    """Each installed tool plugin's class, as an import path (``hybridrl.tools.calculator.Calculator``) → its name."""
    out = {}
    for name in registry.names():
        try:
            out[registry.entry(name).value.replace(":", ".")] = name
        except PluginError:  # claimed twice: named by the error when chosen
            continue
    return out


def _entry(entry: Any, where: str, registry: Registry,
           by_class: dict[str, str]) -> tuple[str, dict[str, Any], list[str]] | str:
    """``(tool, kwargs, notices)`` for one entry of the file, or why it is refused."""
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        return f"{where} has no class_name (verl's entries are {{class_name, config: {{type: native, ...}}, " \
               "tool_schema}})"
    cls_name, config = entry["class_name"], entry.get("config")
    if not isinstance(config, dict) or config.get("type") not in ("native", "mcp"):
        return f"{where} ({cls_name}): config.type must be native (verl's tool types: native, mcp)"
    if config["type"] == "mcp":
        return f"{where} ({cls_name}): verl's MCP tools (config.type: mcp) are not built; hybridrl's are plugins"
    config = {k: v for k, v in config.items() if k != "type"}
    notices: list[str] = []
    tool = cls_name if cls_name in registry.names() else by_class.get(cls_name)
    if not tool and (builtin := VERL_BUILTINS.get(cls_name)) is not None:
        for k, fit in builtin.allowed.items():
            if k in config and config[k] not in fit:
                return f"{where} ({cls_name}): config.{k}={config[k]!r}; hybridrl's {builtin.tool} tool takes " \
                       f"{' or '.join(map(str, fit))}"
        tool, kwargs = builtin.tool, builtin.kwargs(config)
        unused = sorted(set(config) - set(builtin.used) - set(builtin.allowed))
        notices.append(f"{where}: verl's {cls_name} is hybridrl's {tool} tool ({builtin.note}"
                       + (f"; {', '.join(unused)} not used" if unused else "") + ")")
    elif tool:
        kwargs = config
    else:
        installed = ", ".join(f"{n} ({c})" for c, n in sorted(by_class.items(), key=lambda x: x[1])) or "(none)"
        return (f"{where}: class {cls_name!r} is not a hybridrl tool: name an installed tool plugin (group "
                f"hybridrl.tools) by its name or class: {installed}; of verl's own tools, "
                + ", ".join(f"{c} is hybridrl's {b.tool}" for c, b in VERL_BUILTINS.items()))
    try:
        cls = registry.load(tool, key=f"{where}.class_name")
        make_plugin_config(cls, tool, kwargs, key=f"{where}.config")  # the plugin's Config checks its own keys
    except PluginError as e:
        return str(e)
    if (schema := entry.get("tool_schema")) is not None:
        own = getattr(cls, "schema", None) or {}
        differs = _schema_difference(schema, own)
        if differs:
            return (f"{where}: tool_schema {differs} (hybridrl's {tool} tool keeps its own schema, which the policy "
                    "reads): make the file's tool_schema the plugin's, or leave it out")
        given = (schema.get("function") or {}).get("description")
        if given is not None and given != own["function"].get("description"):
            notices.append(f"{where}: the policy reads hybridrl's {tool} description, not the file's")
    return tool, kwargs, notices


def _schema_difference(schema: Any, own: dict[str, Any]) -> str | None:
    """How a verl ``tool_schema`` differs from a plugin's own: the function's name, its parameters and their types,
    the required ones."""
    fn = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(fn, dict):
        return "has no function: {name, description, parameters}"
    mine = own.get("function", {})
    out = []
    if fn.get("name") != mine.get("name"):
        out.append(f"names the function {fn.get('name')!r}, hybridrl's tool {mine.get('name')!r}")
    (types, required), (my_types, my_required) = _parameters(fn), _parameters(mine)
    if types != my_types:
        out.append(f"has the parameters {types}, hybridrl's tool {my_types}")
    if required != my_required:
        out.append(f"requires {required}, hybridrl's tool {my_required}")
    return "; ".join(out) or None


def _parameters(function: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A function schema's parameters (name → JSON type) and the required ones."""
    p = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
    properties = p.get("properties") if isinstance(p.get("properties"), dict) else {}
    types = {k: v.get("type") if isinstance(v, dict) else v for k, v in properties.items()}
    required = p.get("required") if isinstance(p.get("required"), list) else []
    return types, sorted(map(str, required))
