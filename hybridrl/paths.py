"""Where hybridrl finds its recipes and keeps what it builds (imported by config and bootstrap alike)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> str:
    """``$HYBRIDRL_CACHE_DIR``, default ``~/.cache/hybridrl``: the only place ``build_if_missing`` writes."""
    return os.environ.get("HYBRIDRL_CACHE_DIR") or str(Path.home() / ".cache" / "hybridrl")


def in_cache(path: str | os.PathLike[str]) -> bool:
    """``path`` lies inside the cache directory (after resolving ``..`` and symlinks)."""
    return Path(path).resolve().is_relative_to(Path(cache_dir()).resolve())


def recipes_dir() -> Path:
    """``$HYBRIDRL_RECIPES_DIR``, else the ``recipes/`` folder of this source checkout."""
    env = os.environ.get("HYBRIDRL_RECIPES_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[1] / "recipes"
    if not (path / "config.yaml").is_file():
        raise FileNotFoundError(
            f"no recipes at {path} (expected {path / 'config.yaml'}); install hybridrl from a source "
            f"checkout (pip install -e .) or point HYBRIDRL_RECIPES_DIR at a recipes folder"
        )
    return path
