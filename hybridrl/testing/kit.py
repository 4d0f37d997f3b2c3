"""The kit's core: ContractViolation, the plugin under check, and the class/Config check every check runs first."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.registry import (
    GROUPS,
    PROTOCOLS,
    PluginError,
    capability_flags,
    default_flags,
    give_default_flags,
    make_plugin_config,
)

CONFIG_KEYS: dict[str, str] = {  # where the trainer's config holds each group's plugin config
    "rollout_engines": "actor_rollout_ref.rollout.engine_kwargs",
    "reward_managers": "reward.kwargs",
    "advantage_estimators": "algorithm.adv_estimator_kwargs",
    "policy_losses": "algorithm.policy_loss_kwargs",
    "tools": "actor_rollout_ref.rollout.multi_turn.tool_kwargs",
    "environments": "actor_rollout_ref.rollout.multi_turn.environment_kwargs",
}
EXTRA_CTX_KEY = "hybridrl_testing_unknown_ctx"  # passed to engines: later versions may add context keys


class ContractViolation(AssertionError):
    """A plugin broke its group's contract; the message names the plugin and the check."""


class _Plugin:
    """The plugin under check: names it in every failure."""

    def __init__(self, cls: type, group: str) -> None:
        if group not in GROUPS:
            raise ValueError(f"unknown plugin group {group!r}; valid: {sorted(GROUPS)}")
        self.cls, self.group = cls, group
        self.who = f"{group} plugin {getattr(cls, '__module__', '?')}:{getattr(cls, '__qualname__', cls)!s}"

    def fail(self, check: str, detail: str) -> NoReturn:
        raise ContractViolation(f"{self.who} fails the check {check!r}: {detail}")

    def expect(self, ok: bool, check: str, detail: str | Callable[[], str]) -> None:
        if not ok:
            self.fail(check, detail() if callable(detail) else detail)

    @contextmanager
    def step(self, check: str) -> Iterator[None]:
        """Run plugin code; any exception it raises fails ``check``."""
        try:
            yield
        except ContractViolation:
            raise
        except Exception as e:
            raise ContractViolation(f"{self.who} fails the check {check!r}: it raised {type(e).__name__}: {e}") from e


# ---- the class and its Config ----------------------------------------------------------------------


def check_plugin_class(cls: type, group: str, *, config: Any = None) -> Any:
    """Check ``cls``'s ``Config`` and capability flags for ``group`` (a key of ``registry.GROUPS``);
    return ``config``, or ``cls.Config()`` when it is None."""
    p = _Plugin(cls, group)
    config_cls = getattr(cls, "Config", None)
    p.expect(isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls), "nested Config dataclass",
             "the class has no nested `Config` dataclass; every plugin declares one (it may be empty)")
    assert isinstance(config_cls, type)
    positional = [f.name for f in dataclasses.fields(config_cls) if f.init and not f.kw_only]
    p.expect(not positional, "Config is kw-only",
             f"fields {positional} can be passed by position; declare @dataclass(kw_only=True)")
    give_default_flags(cls, PROTOCOLS[group])  # as the registry does when it loads the plugin
    flags = [*capability_flags(PROTOCOLS[group]), *default_flags(PROTOCOLS[group])]
    bad = [f for f in flags if not isinstance(getattr(cls, f, None), bool)]
    p.expect(not bad, "capability flags", lambda: f"the {PROTOCOLS[group].__name__} protocol needs the class "
             f"attributes {flags}, each a bool; {', '.join(f'{f}={getattr(cls, f, None)!r}' for f in bad)}")
    if config is None:
        with p.step("Config() from its defaults (pass config=... when a field has none)"):
            config = config_cls()
    p.expect(isinstance(config, config_cls), "config type",
             f"config is a {type(config).__name__}, expected {config_cls.__qualname__}")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    try:  # what `reward.kwargs` & co. go through at start-up: the field values must pass it
        make_plugin_config(cls, cls.__qualname__, values, key=CONFIG_KEYS[group])
    except PluginError as e:
        p.fail("Config values pass hybridrl's config validation", str(e))
    return config


def _tensors(batch: RolloutBatch) -> dict[str, torch.Tensor]:
    return {f.name: getattr(batch, f.name).clone() for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)}


def _tensors_equal(before: Mapping[str, torch.Tensor], now: Mapping[str, Any]) -> bool:
    """Every tensor of ``before`` is still in ``now``, unchanged."""
    return all(isinstance(now.get(k), torch.Tensor) and torch.equal(v, now[k]) for k, v in before.items())
