"""The command line checked whole before Hydra composes it: every unknown key and bad value in one error.

Hydra stops at the first override it cannot apply, so a launch script with ten keys we do not know took ten
runs to read. Here each ``key=value`` is parsed with Hydra's own override grammar and tried on its own against
the typed schema (``OmegaConf.structured``: the same type conversion Hydra applies), and every problem is
collected, each with the valid keys closest to it. A ``recipe=NAME`` file's keys are checked the same way.

verl's keys (:mod:`hybridrl.config.verl_keys`) are read first: a key hybridrl spells differently is
translated to its hybridrl key, one that has no effect here is set aside, each with a one-line notice, and one
that cannot run here is an error naming what to use. What is left goes to Hydra unchanged.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.verl_keys import AOR, FSDP, VerlKey, lookup


@dataclass(slots=True, kw_only=True)
class CheckedOverrides:
    overrides: list[str]  # what Hydra composes (verl's keys translated)
    notices: list[str] = field(default_factory=list)  # one line per verl key translated or set aside
    # verl's engine knobs (``status: engine``): applied to the composed config, whose rollout.name decides where
    engine_settings: list[tuple[VerlKey, Any]] = field(default_factory=list)
    # verl's keys read together once the config is composed (``status: joint``): group → {verl key: value}
    joint: dict[str, dict[str, Any]] = field(default_factory=dict)
    issues: list[ConfigIssue] = field(default_factory=list)  # collect=True: the problems (their lines left out)
    composable: bool = True  # false: the recipe file has unknown keys, on which Hydra would stop


def check_overrides(overrides: Sequence[str], *, schema: type, recipes: Path | None = None,
                    verl: bool = True, collect: bool = False) -> CheckedOverrides:
    """``overrides`` as Hydra should compose them; raises ConfigError listing every key of them (and of the
    ``recipe=`` file under ``recipes``) that the schema does not have, and every value its type refuses.
    ``collect``: return them in ``issues`` instead (the overrides hold only the lines without one), so that what
    composition finds is reported with them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    checked, issues = CheckedOverrides(overrides=[]), []
    typed = OmegaConf.structured(schema)
    fsdp: list[str] = []  # verl's FSDP-engine keys: one issue for all of them
    implied: list[str] = []
    assigned: dict[str, list[tuple[str, Any]]] = {}  # hybridrl key → (the key the command line wrote, value)
    for line in overrides:
        try:
            (o,) = parser.parse_overrides([line])
        except HydraException as e:
            issues.append(ConfigIssue(key=line, value=None, message=f"not an override: {str(e).splitlines()[0]}"))
            continue
        key = o.key_or_group
        if o.package is not None or key.startswith("hydra") or (recipes is not None and (recipes / key).is_dir()):
            checked.overrides.append(line)  # a config group (recipe=...) or Hydra's own settings
            continue
        entry = lookup(key) if verl else None
        lines = [(line, key)]
        if entry is not None and (entry.status != "same" or entry.values):
            value = None if o.is_delete() or o.is_sweep_override() else o.value()
            if entry.group == FSDP and (entry.status == "refused" or entry.refuses(value)):
                fsdp.append(key if entry.status == "refused" else f"{key}={value}")
                continue
            if entry.status == "refused" or (entry.status in ("ignored", "joint") and entry.refuses(value)):
                issues.append(ConfigIssue(key=key, value=None if entry.status == "refused" else value,
                                          message=f"verl's key is not supported here: {entry.note}"))
                continue
            if entry.status == "engine":
                if value is not None:
                    checked.engine_settings.append((entry, value))
                continue
            if entry.status == "joint":
                checked.joint.setdefault(entry.group, {})[key] = value
                continue
            if entry.status == "ignored":
                checked.notices.append(entry.notice(key=key))
                continue
            lines = _translated(line, o, entry, schema)
            if entry.status == "alias":
                checked.notices.append(entry.notice())
                implied += entry.implies
        for line, key in lines:
            (o,) = parser.parse_overrides([line])
            if not (o.is_delete() or o.is_sweep_override()):
                assigned.setdefault(key, []).append((o.key_or_group if entry is None else entry.key, o.value()))
            if (issue := _line_issue(o, key, schema, typed)) is not None:
                issues.append(issue)
                continue
            checked.overrides.append(_as_list(parser, o, line, key, schema))
    if fsdp:
        issues.append(ConfigIssue(key="model_engine", value=None, message=(
            f"{', '.join(fsdp)}: verl's FSDP engine; hybridrl trains with Megatron only (verl's "
            f"model_engine=megatron): drop them and use the script's Megatron keys "
            f"({AOR}.actor.megatron.param_offload / optimizer_offload for the offload, "
            f"megatron.context_parallel_size for Ulysses' sequence split)")))
    issues += _disagreements(assigned)
    checked.overrides += list(dict.fromkeys(i for i in implied if i.split("=", 1)[0] not in assigned))
    if recipes is not None and (in_recipe := _recipe_problems(overrides, schema, recipes, parser)):
        issues += in_recipe
        checked.composable = False
    if issues and not collect:
        raise ConfigError(issues)
    checked.issues = issues
    return checked


def _translated(line: str, o: Any, entry: VerlKey, schema: type) -> list[tuple[str, str]]:
    """``(line, key)`` for each hybridrl key a verl override becomes: its value renamed (``values``), and, for an
    alias, the target and ``also`` keys."""
    value = line.split("=", 1)[1] if "=" in line else ""
    if not o.is_sweep_override() and not o.is_delete():
        value = entry.values.get(str(o.value()), value)
    if entry.status == "same":
        return [(f"{line.split('=', 1)[0]}={value}", entry.key)]
    assert entry.target is not None
    return [(f"{'++' if _free_form_part(schema, t) else ''}{t}={value}", t) for t in (entry.target, *entry.also)]


def _line_issue(o: Any, key: str, schema: type, typed: Any) -> ConfigIssue | None:
    """What the schema says about one override: an unknown key, or a value its type refuses."""
    if o.is_delete() or o.is_sweep_override():
        return None
    if (problem := key_problem(schema, key)) is not None:
        return ConfigIssue(key=key, value=None, message=problem)
    if _free_form_part(schema, key):
        return None
    value = o.value()
    if isinstance(value, str) and _is_list(schema, key) and "${" not in value:
        value = [value]
    if (bad := _value_problem(typed, schema, key, value)) is not None:
        return ConfigIssue(key=key, value=o.value(), message=bad)
    return None


def _as_list(parser: Any, o: Any, line: str, key: str, schema: type) -> str:
    """A lone value for a list key as a list of one (as verl reads a lone path)."""
    if o.is_delete() or o.is_sweep_override() or not isinstance(o.value(), str) or "${" in o.value():
        return line
    if not _is_list(schema, key):
        return line
    quoted = o.value().replace("\\", "\\\\").replace("'", "\\'")
    return f"{line.split('=', 1)[0]}=['{quoted}']"


def _disagreements(assigned: dict[str, list[tuple[str, Any]]]) -> list[ConfigIssue]:
    """A hybridrl key the command line sets twice, one of them by a verl spelling, to two values."""
    out = []
    for key, sets in assigned.items():
        values = {repr(v) for _, v in sets}
        if len(values) > 1 and any(origin != key for origin, _ in sets):
            (origin, value), *rest = sets
            others = ", ".join(f"{o}={v!r}" for o, v in rest)
            out.append(ConfigIssue(key=origin, value=value, message=f"disagrees with {others} (both set {key}): "
                                                                     "set one"))
    return out


def apply_engine_settings(cfg: Any, settings: list[tuple[VerlKey, Any]]) -> list[str]:
    """verl's engine knobs into the composed config's ``rollout.engine_kwargs``, named as the chosen engine names
    them; returns the notices. A knob also set in engine_kwargs itself must agree with it."""
    rollout, notices, issues = cfg.actor_rollout_ref.rollout, [], []
    for entry, value in settings:
        notices.append(entry.notice(rollout.name))
        where = entry.engines.get(rollout.name)
        if where is None:
            continue
        if where in rollout.engine_kwargs and rollout.engine_kwargs[where] != value:
            issues.append(ConfigIssue(key=entry.key, value=value, message=(
                f"disagrees with {AOR}.rollout.engine_kwargs.{where}={rollout.engine_kwargs[where]!r}: set one")))
            continue
        rollout.engine_kwargs[where] = value
    if issues:
        raise ConfigError(issues)
    return notices


def key_problem(schema: type, key: str) -> str | None:
    """Why ``key`` is not a key of ``schema`` (with the closest valid keys), or None. Keys under a free-form
    block (a plugin's kwargs: ``dict[str, Any]``) are that plugin's to check."""
    node: Any = schema
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not is_dataclass(node):
            return None if _free_form(node) else f"{'.'.join(parts[:i])} is a value, not a block"
        hints = typing.get_type_hints(node)
        names = {f.name for f in fields(node)}
        if part not in names:
            return _unknown(schema, key)
        node = hints[part]
    return None


RENAMED = {"trainer.loggers": "trainer.logger", "trainer.save_every": "trainer.save_freq"}  # hybridrl's old names


def schema_keys(node: type, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the schema (for suggestions and docs)."""
    hints = typing.get_type_hints(node)
    for f in fields(node):  # type: ignore[arg-type]
        yield prefix + f.name
        if is_dataclass(hints[f.name]):
            yield from schema_keys(hints[f.name], f"{prefix}{f.name}.")


def _unknown(schema: type, key: str) -> str:
    if key in RENAMED:
        return f"is now {RENAMED[key]} (verl's name)"
    keys = [k for k in schema_keys(schema) if not key.startswith(k + ".")]
    parent, _, leaf = key.rpartition(".")
    siblings = [k for k in keys if k.rpartition(".")[0] == parent]
    close = [f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(
        leaf, [k.rpartition(".")[2] for k in siblings], n=3, cutoff=0.6)]
    close = close or difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    if not close:  # the same last name elsewhere in the tree (verl and hybridrl place some keys differently)
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:3]
    message = "is not a config key" + (f"; did you mean {' or '.join(close)}?" if close else "")
    if key.split(".")[0] in ("actor_rollout_ref", "data", "trainer", "algorithm", "critic",
                             "reward_model", "custom_reward_function"):
        message += " (verl's keys and their hybridrl names: docs/verl.md)"
    return message


def _is_list(schema: type, key: str) -> bool:
    node: Any = schema
    for part in key.split("."):
        if not is_dataclass(node):
            return False
        node = typing.get_type_hints(node)[part]
    return (typing.get_origin(node) or node) is list


def _free_form(node: Any) -> bool:
    origin = typing.get_origin(node) or node
    return node is Any or origin is dict


def _free_form_part(schema: type, key: str) -> bool:
    """``key`` lies inside a free-form block (set with ``++``: it may not exist yet)."""
    node: Any = schema
    for part in key.split("."):
        if _free_form(node):
            return True
        if not is_dataclass(node) or part not in {f.name for f in fields(node)}:
            return False
        node = typing.get_type_hints(node)[part]
    return False


def _value_problem(typed: Any, schema: type, key: str, value: Any) -> str | None:
    """What the schema's type of ``key`` says about ``value`` (Hydra would refuse it), or None."""
    if isinstance(value, str) and "${" in value:
        return None  # an interpolation: resolved after composition
    try:
        OmegaConf.update(typed, key, value, force_add=False)
    except OmegaConfBaseException as e:
        return str(e).splitlines()[0]
    except (ValueError, TypeError) as e:
        return str(e).splitlines()[0]
    return None


def _recipe_problems(overrides: Sequence[str], schema: type, recipes: Path, parser: Any) -> list[ConfigIssue]:
    """Unknown keys in the ``recipe=NAME`` file the overrides choose (a user's own recipe)."""
    name = None
    for line in overrides:
        if line.split("=", 1)[0].lstrip("+") == "recipe" and "=" in line:
            name = line.split("=", 1)[1]
    path = recipes / "recipe" / f"{name}.yaml" if name else None
    if path is None or not path.is_file():
        return []  # Hydra names a missing recipe with the available ones
    try:
        node = OmegaConf.load(path)
    except (OSError, OmegaConfBaseException) as e:
        return [ConfigIssue(key="recipe", value=name, message=f"{path}: {e}")]
    issues = []
    for key in _leaf_keys(OmegaConf.to_container(node, resolve=False)):
        if key.split(".")[0] == "defaults" or key.startswith("hydra"):
            continue
        if (problem := key_problem(schema, key)) is not None:
            issues.append(ConfigIssue(key=key, value=None, message=f"in {path}: {problem}"))
    return issues


def _leaf_keys(d: Any, prefix: str = "") -> list[str]:
    if not isinstance(d, dict) or not d:
        return [prefix.rstrip(".")] if prefix else []
    return [k for name, v in d.items() for k in _leaf_keys(v, f"{prefix}{name}.")]

