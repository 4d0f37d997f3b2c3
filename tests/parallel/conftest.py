"""A tiny Qwen2 checkpoint for the layout-equivalence tests, made once per session.

``make_tiny_model`` draws norms = 1 and biases = 0 and nearly uniform attention, which would hide a
misplaced norm, QKV bias or position; the root conftest's ``discriminate`` fixture redraws every 1-D
tensor (norms ≈ 1 ± 0.2, biases ≈ ±0.1) and scales the q/k projections ×8.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hybridrl.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def rl_model(tmp_path_factory: pytest.TempPathFactory, discriminate: Callable[[Path, int], Path]) -> Path:
    """4 layers (2 per stage at PP=2), 4 heads / 2 KV groups (1 per rank at TP=2), tied embeddings."""
    out = tmp_path_factory.mktemp("parallel") / "tiny-qwen2"
    make_tiny_model(out, arch="qwen2", hidden=64, layers=4, heads=4, kv_heads=2, max_positions=128, tie=True,
                    seed=3)
    return discriminate(out, seed=3)
