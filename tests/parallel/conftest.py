"""A tiny Qwen2 checkpoint for the layout-equivalence tests, made once per session.

``make_tiny_model`` draws norms = 1 and biases = 0 and nearly uniform attention, which would hide a
misplaced norm, QKV bias or position; as in ``tests/megatron/conftest.py``, every 1-D tensor is
redrawn (norms ≈ 1 ± 0.2, biases ≈ ±0.1) and the q/k projections are scaled ×8.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridrl.models.tiny import make_tiny_model


def redraw_norms_and_biases(model_dir: Path, seed: int) -> Path:
    path = model_dir / "model.safetensors"
    state = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if t.ndim == 1:
            noise = torch.randn(t.shape, generator=gen)
            state[name] = noise * 0.1 if name.endswith("bias") else 1 + 0.2 * noise
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            state[name] = t * 8
    save_file(state, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="session")
def rl_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers (2 per stage at PP=2), 4 heads / 2 KV groups (1 per rank at TP=2), tied embeddings."""
    out = tmp_path_factory.mktemp("parallel") / "tiny-qwen2"
    make_tiny_model(out, arch="qwen2", hidden=64, layers=4, heads=4, kv_heads=2, max_positions=128, tie=True,
                    seed=3)
    return redraw_norms_and_biases(out, seed=3)
