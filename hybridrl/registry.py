"""One plugin registry for every extension point, read from setuptools entry points.

Built-in plugins are declared in hybridrl's own ``pyproject.toml`` exactly like a third-party
package declares its plugins, so there is a single dispatch path::

    [project.entry-points."hybridrl.reward_managers"]
    my_reward = "my_pkg.rewards:MyReward"

A plugin is a class with a nested kw-only ``Config`` dataclass; it is built as ``cls(config, **ctx)``.
It also declares, as plain ``bool`` class attributes, the capability flags of its group's protocol
(``ClassVar[bool]`` in ``hybridrl.interfaces``, e.g. ``AdvantageEstimator.needs_group``); ``load``
checks both, so callers read ``cls.needs_group`` directly and a third-party plugin learns at once.
Loading is lazy: listing plugins reads only package metadata; a plugin's module is imported when
the plugin is chosen (``load``). A new entry point needs a (re)install of its distribution, since
metadata is written at install time.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from hybridrl.interfaces import AdvantageEstimator, Environment, PolicyLoss, RewardManager, RolloutEngine, Tool

GROUPS: dict[str, str] = {
    "rollout_engines": "hybridrl.rollout_engines",
    "reward_managers": "hybridrl.reward_managers",
    "advantage_estimators": "hybridrl.advantage_estimators",
    "policy_losses": "hybridrl.policy_losses",
    "tools": "hybridrl.tools",
    "environments": "hybridrl.environments",
}
# the protocol that the plugins of each group implement
PROTOCOLS: dict[str, type] = {
    "rollout_engines": RolloutEngine,
    "reward_managers": RewardManager,
    "advantage_estimators": AdvantageEstimator,
    "policy_losses": PolicyLoss,
    "tools": Tool,
    "environments": Environment,
}


def capability_flags(protocol: type) -> list[str]:
    """The protocol's ``ClassVar[bool]`` attributes without a default, which every plugin class of its group
    declares."""
    return [n for n in _bool_class_vars(protocol) if not hasattr(protocol, n)]


def default_flags(protocol: type) -> dict[str, bool]:
    """The protocol's ``ClassVar[bool]`` attributes with a default: a plugin class may leave them out."""
    return {n: getattr(protocol, n) for n in _bool_class_vars(protocol) if hasattr(protocol, n)}


def give_default_flags(cls: type, protocol: type) -> None:
    """Set on ``cls`` each flag of :func:`default_flags` it does not declare (callers read every flag as a plain
    class attribute)."""
    for flag, default in default_flags(protocol).items():
        if not hasattr(cls, flag):
            setattr(cls, flag, default)


def _bool_class_vars(protocol: type) -> list[str]:
    return [n for n, tp in typing.get_type_hints(protocol).items()
            if typing.get_origin(tp) is typing.ClassVar and typing.get_args(tp) == (bool,)]


class PluginError(Exception):
    """Base class of every plugin lookup/config error."""


class PluginNotFoundError(PluginError):
    pass


class DuplicatePluginError(PluginError):
    pass


class PluginConfigError(PluginError):
    pass


class PluginLoadError(PluginError):
    pass


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginEntry:
    group: str  # short group name, e.g. "reward_managers"
    name: str
    value: str  # "module:attr"
    distribution: str
    version: str

    def load(self) -> type:
        ep = metadata.EntryPoint(name=self.name, value=self.value, group=GROUPS[self.group])
        try:
            return ep.load()
        except Exception as e:  # surface which plugin and which distribution broke
            raise PluginLoadError(
                f"plugin {self.name!r} ({self.group}) from {self.distribution} {self.version} "
                f"failed to import {self.value!r}: {type(e).__name__}: {e}"
            ) from e


def _scan(group: str) -> dict[str, list[PluginEntry]]:
    """Every entry point of one group, by name; several distributions may claim one name."""
    return _scan_all(tuple(sys.path)).get(group, {})


@functools.cache
def _scan_all(path: tuple[str, ...]) -> dict[str, dict[str, list[PluginEntry]]]:
    """Every entry point of every group, read once per ``sys.path`` (a run builds ~20 registries; each scan used
    to parse the METADATA of all ~300 installed distributions: 0.1 s each). Only the distributions that declare
    one of our groups have their METADATA read, for the name and version errors show."""
    ours = {v: k for k, v in GROUPS.items()}
    found: dict[str, dict[str, list[PluginEntry]]] = {}
    seen: set[tuple[str, str, str, str]] = set()
    for dist in metadata.distributions(path=list(path)):
        eps = [ep for ep in dist.entry_points if ep.group in ours]
        if not eps:
            continue
        dist_name = dist.metadata["Name"] or "?"
        for ep in eps:
            # the same distribution can be visible twice on sys.path (e.g. an editable install
            # plus a build dir); that is one plugin, not a conflict
            key = (ep.group, ep.name, dist_name.lower().replace("_", "-"), ep.value)
            if key in seen:
                continue
            seen.add(key)
            group = ours[ep.group]
            found.setdefault(group, {}).setdefault(ep.name, []).append(
                PluginEntry(group=group, name=ep.name, value=ep.value, distribution=dist_name, version=dist.version)
            )
    return found


class Registry:
    """The plugins of one entry-point group (see ``GROUPS``)."""

    def __init__(self, group: str) -> None:
        if group not in GROUPS:
            raise ValueError(f"unknown plugin group {group!r}; valid: {sorted(GROUPS)}")
        self.group = group
        self._entries: dict[str, list[PluginEntry]] | None = None
        self._loaded: dict[str, type] = {}

    def _all(self) -> dict[str, list[PluginEntry]]:
        if self._entries is None:
            self._entries = _scan(self.group)
        return self._entries

    def names(self) -> list[str]:
        return sorted(self._all())

    def entry(self, name: str, *, key: str | None = None) -> PluginEntry:
        """The entry point for ``name``; ``key`` is the config key that chose it (for errors)."""
        where = f"{key}={name!r}" if key else repr(name)
        entries = self._all().get(name)
        if not entries:
            installed = ", ".join(self.names()) or "(none)"
            raise PluginNotFoundError(
                f"{where}: no {self.group} plugin named {name!r} is installed; installed: {installed}. "
                f"A plugin is installed with `pip install <its package>` and declares an entry point "
                f"in group {GROUPS[self.group]!r}."
            )
        if len(entries) > 1:
            who = "; ".join(f"{e.distribution} {e.version} ({e.value})" for e in entries)
            raise DuplicatePluginError(
                f"{where}: {self.group} plugin {name!r} is provided by more than one distribution: "
                f"{who}. Uninstall one of them."
            )
        return entries[0]

    def load(self, name: str, *, key: str | None = None) -> type:
        if name not in self._loaded:
            entry = self.entry(name, key=key)
            cls = entry.load()
            config_cls = getattr(cls, "Config", None)
            if config_cls is None or not dataclasses.is_dataclass(config_cls):
                raise PluginLoadError(
                    f"{self.group} plugin {name!r} ({entry.value}) has no nested "
                    f"`Config` dataclass; every plugin declares one (it may be empty)."
                )
            self._check_flags(entry, cls)
            self._loaded[name] = cls
        return self._loaded[name]

    def _check_flags(self, entry: PluginEntry, cls: type) -> None:
        protocol = PROTOCOLS[self.group]
        give_default_flags(cls, protocol)
        problems = [f"`{flag}` is missing" if not hasattr(cls, flag) else f"`{flag}` is {getattr(cls, flag)!r}"
                    for flag in [*capability_flags(protocol), *default_flags(protocol)]
                    if not isinstance(getattr(cls, flag, None), bool)]
        if problems:
            raise PluginLoadError(
                f"{self.group} plugin {entry.name!r} ({entry.value}) from {entry.distribution} {entry.version}: "
                f"{', '.join(problems)}; the {protocol.__name__} protocol (hybridrl.interfaces) requires the "
                f"class attributes {', '.join(capability_flags(protocol))} (each a bool), read before the "
                f"plugin is built."
            )

    def make_config(self, name: str, kwargs: Mapping[str, Any] | None, *, key: str) -> Any:
        """Validate ``kwargs`` (the plugin's config block at ``key``) against its Config dataclass."""
        return make_plugin_config(self.load(name, key=key), name, kwargs or {}, key=key)

    def build(self, name: str, kwargs: Mapping[str, Any] | None, *, key: str, **ctx: Any) -> Any:
        cls = self.load(name, key=key)
        return cls(self.make_config(name, kwargs, key=key), **ctx)


def make_plugin_config(cls: type, name: str, kwargs: Mapping[str, Any], *, key: str) -> Any:
    """Build ``cls.Config(**kwargs)``, turning every mistake into one error naming ``key``."""
    config_cls = cls.Config  # type: ignore[attr-defined]
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    hints = typing.get_type_hints(config_cls)
    problems: list[str] = []
    valid = ", ".join(f"{n}: {_type_name(hints.get(n))}" for n in fields) or "(none)"
    for k in kwargs:
        if k not in fields:
            problems.append(f"unknown key {key}.{k}")
    for n, f in fields.items():
        if n in kwargs:
            if not _type_ok(kwargs[n], hints.get(n)):
                problems.append(
                    f"{key}.{n}={kwargs[n]!r} has type {type(kwargs[n]).__name__}, "
                    f"expected {_type_name(hints.get(n))}"
                )
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append(f"missing required key {key}.{n}")
    if problems:
        raise PluginConfigError(
            f"plugin {name!r} at {key}: " + "; ".join(problems) + f". Valid keys of {name!r}: {valid}"
        )
    try:
        return config_cls(**dict(kwargs))
    except (TypeError, ValueError) as e:  # the plugin's own __post_init__ checks
        raise PluginConfigError(f"plugin {name!r} at {key}: {e}. Valid keys of {name!r}: {valid}") from e


def _type_name(tp: Any) -> str:
    if tp is None:
        return "any"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _type_ok(value: Any, tp: Any) -> bool:
    """A shallow isinstance check for config values coming from YAML (ints are accepted as floats)."""
    if tp is None or tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if origin is not None:
        tp = origin
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp in (list, tuple):
        return isinstance(value, (list, tuple))
    if tp is dict:
        return isinstance(value, Mapping)
    try:
        return isinstance(value, tp)
    except TypeError:
        return True


def all_entries() -> list[PluginEntry]:
    """Every installed plugin of every group (metadata only; nothing is imported)."""
    out: list[PluginEntry] = []
    for group in GROUPS:
        for entries in _scan(group).values():
            out.extend(entries)
    return sorted(out, key=lambda e: (e.group, e.name, e.distribution))


def format_plugin_table(entries: list[PluginEntry]) -> str:
    rows = [("GROUP", "NAME", "DISTRIBUTION", "VERSION", "OBJECT")]
    rows += [(e.group, e.name, e.distribution, e.version, e.value) for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)
