"""``hybridrl validate``: compose a recipe, run the static checks, print the resolved topology."""

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
        topology = validate(cfg, world_size=world_size, model_config=model_config)
    except ConfigError as e:
        print(f"hybridrl validate: {e}", file=sys.stderr)
        return 2
    print(topology.render())
    if model_config is not None:
        print(f"planned with the architecture of {model_config}; local weights, tokenizer and data files "
              f"were not checked")
    print("config OK")
    return 0
