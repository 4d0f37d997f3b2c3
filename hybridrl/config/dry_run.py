"""``hybridrl validate``: compose a recipe, run the static checks, print the run's plan (what runs where)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.schema import RLConfig
from hybridrl.config.validate import validate


def main(overrides: Sequence[str], *, world_size: int | None = None, model_config: Path | None = None,
         get: Sequence[str] = ()) -> int:
    """Check and print the plan; with ``get``, the plan goes to stderr and stdout holds the resolved value of each
    key of ``get`` (derived settings filled in: the run's values), one line each."""
    with contextlib.redirect_stdout(sys.stderr) if get else contextlib.nullcontext():
        code, cfg = _check(overrides, world_size=world_size, model_config=model_config)
    for key in get if cfg is not None else ():
        value = functools.reduce(getattr, key.split("."), cfg)
        print(value if isinstance(value, str) else json.dumps(dataclasses.asdict(value) if
                                                              dataclasses.is_dataclass(value) else value))
    return code


def _check(overrides: Sequence[str], *, world_size: int | None,
           model_config: Path | None) -> tuple[int, RLConfig | None]:
    try:
        cfg = compose_config(overrides)
        # what build_if_missing will build on the first run is reported as pending, not missing
        plan = validate(cfg, world_size=world_size, model_config=model_config, before_bootstrap=True)
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
