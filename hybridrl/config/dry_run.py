"""``hybridrl validate``: compose a recipe, run the static checks, print the resolved topology."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hybridrl.config.compose import compose_config
from hybridrl.config.errors import ConfigError
from hybridrl.config.validate import validate


def main(overrides: Sequence[str], *, world_size: int | None = None) -> int:
    try:
        cfg = compose_config(overrides)
        topology = validate(cfg, world_size=world_size)
    except ConfigError as e:
        print(f"hybridrl validate: {e}", file=sys.stderr)
        return 2
    print(topology.render())
    print("config OK")
    return 0
