"""``hybridrl validate``: compose a recipe, run the static checks, print the run's plan (what runs where)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.overrides import key_problem
from hybridrl.config.schema import RLConfig
from hybridrl.config.validate import validate
from hybridrl.config.verl_keys import AOR, lookup
from hybridrl.registry import Registry


def main(overrides: Sequence[str], *, world_size: int | None = None, model_config: Path | None = None,
         get: Sequence[str] = (), teacher_config: Path | None = None) -> int:
    """Check and print the plan; with ``get``, the plan goes to stderr and stdout holds the resolved value of each
    key of ``get`` (derived settings filled in: the run's values), one line each. A key of ``get`` may be verl's
    (:func:`value_of`)."""
    with contextlib.redirect_stdout(sys.stderr) if get else contextlib.nullcontext():
        code, cfg = _check(overrides, world_size=world_size, model_config=model_config, teacher_config=teacher_config)
    for key in get if cfg is not None else ():
        try:
            value = value_of(cfg, key)
        except KeyError as e:
            print(f"hybridrl validate: --get {key}: {e.args[0]}", file=sys.stderr)
            return 2
        print(value if isinstance(value, str) else json.dumps(dataclasses.asdict(value) if
                                                              dataclasses.is_dataclass(value) else value))
    return code


# the plugin blocks: key → (plugin group, the key that chooses the plugin)
PLUGIN_BLOCKS = {"algorithm.policy_loss_kwargs": ("policy_losses", "algorithm.policy_loss"),
                 "algorithm.adv_estimator_kwargs": ("advantage_estimators", "algorithm.adv_estimator"),
                 "actor_rollout_ref.rollout.engine_kwargs": ("rollout_engines", "actor_rollout_ref.rollout.name"),
                 "reward.kwargs": ("reward_managers", "reward.name")}


def value_of(cfg: RLConfig, key: str) -> object:
    """``key``'s value in the run's (derived) config: a schema key; a key of a plugin block (the chosen plugin's
    value, its Config's default where the block leaves it out); or one of verl's keys, read as its hybridrl key
    (:mod:`hybridrl.config.verl_keys`) and given in verl's spelling. Raises KeyError saying why there is none."""
    entry = lookup(key) if key_problem(RLConfig, key) is not None else None
    if entry is None:
        return _read(cfg, key)
    if entry.status == "engine":
        engine = cfg.actor_rollout_ref.rollout.name
        if engine not in entry.engines:
            raise KeyError(entry.notice(engine, key=key))
        return _read(cfg, f"{AOR}.rollout.engine_kwargs.{entry.engines[engine]}")
    if entry.status != "alias":
        raise KeyError(entry.notice(key=key) if entry.status == "ignored" else
                       f"verl's key has no single hybridrl value here ({entry.status}): {entry.note}")
    problems = []
    for target in (str(entry.target), *entry.also):
        try:
            value = _read(cfg, target)
        except KeyError as e:
            problems.append(e.args[0])
            continue
        verl = {v: k for k, v in entry.values.items()}  # the value in verl's spelling
        return (None if verl[str(value)] == "None" else yaml.safe_load(verl[str(value)])) if str(value) in verl \
            else value
    raise KeyError("; ".join(problems))


def _read(cfg: RLConfig, key: str) -> object:
    for block, (group, chooser) in PLUGIN_BLOCKS.items():
        if key.startswith(block + "."):
            name, rest = _read(cfg, chooser), key.removeprefix(block + ".").split(".")
            if rest[0] in Registry(group).names() and len(rest) > 1:  # a plugin's own block (plugin_kwargs.py)
                if rest[0] != name:
                    raise KeyError(f"{key} has no effect: {chooser}={name!r}")
                rest = rest[1:]
            config = Registry(group).make_config(str(name), dict(_read(cfg, block)), key=block)  # type: ignore[arg-type]
            if not hasattr(config, rest[0]):
                raise KeyError(f"{name!r} ({chooser}) has no {rest[0]!r}")
            return functools.reduce(lambda o, k: o[k] if isinstance(o, dict) else getattr(o, k), rest[1:],
                                    getattr(config, rest[0]))
    value: object = cfg
    for part in key.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


def _check(overrides: Sequence[str], *, world_size: int | None, model_config: Path | None,
           teacher_config: Path | None = None) -> tuple[int, RLConfig | None]:
    try:
        cfg = compose_config(overrides)
        # what build_if_missing will build on the first run is reported as pending, not missing
        plan = validate(cfg, world_size=world_size, model_config=model_config, before_bootstrap=True,
                        teacher_config=teacher_config)
    except ConfigError as e:
        print(f"hybridrl validate: {e}", file=sys.stderr)
        return 2, None
    print(plan.render())
    m = cfg.actor_rollout_ref.model
    if m.build_if_missing is not None and not Path(m.path).exists():
        print(f"actor_rollout_ref.model.path={m.path} does not exist yet: the run builds it first "
              f"(build_if_missing={m.build_if_missing}) and then checks it")
    if model_config is not None:
        print(f"planned with the architecture of {model_config}; local weights, tokenizer and data files "
              f"were not checked")
    print("config OK")
    return 0, plan.config
