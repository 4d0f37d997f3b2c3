"""``hybridrl validate``: compose a recipe, run the static checks, print the run's plan (what runs where)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate


def main(overrides: Sequence[str], *, world_size: int | None = None, model_config: Path | None = None) -> int:
    try:
        cfg = compose_config(overrides)
        # what build_if_missing will build on the first run is reported as pending, not missing
        plan = validate(cfg, world_size=world_size, model_config=model_config, before_bootstrap=True)
    except ConfigError as e:
        print(f"hybridrl validate: {e}", file=sys.stderr)
        return 2
    print(plan.render())
    m = cfg.actor_rollout_ref.model
    if m.build_if_missing is not None and not Path(m.path).exists():
        print(f"actor_rollout_ref.model.path={m.path} does not exist yet: the run builds it first "
              f"(build_if_missing={m.build_if_missing}) and then checks it")
    if model_config is not None:
        print(f"planned with the architecture of {model_config}; local weights, tokenizer and data files "
              f"were not checked")
    print("config OK")
    return 0
