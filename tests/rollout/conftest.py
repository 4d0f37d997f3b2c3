"""One vLLM engine for the package's vLLM tests (``test_vllm_engine.py``, ``test_vllm_compat.py``): each start costs
~15 s here. Built only when a test asks for it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.models.tiny import make_tiny_model

VLLM_SMALL = dict(hidden=64, layers=2, heads=2, kv_heads=1, max_positions=256)  # head_dim 32: vLLM's CPU minimum


@pytest.fixture(scope="package")
def vllm_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("vllm_engine")
    return (make_tiny_model(tmp / "a", seed=1, **VLLM_SMALL),  # type: ignore[arg-type]
            make_tiny_model(tmp / "b", seed=2, **VLLM_SMALL))  # type: ignore[arg-type]


@pytest.fixture(scope="package")
def vllm_engine(vllm_models: tuple[Path, Path]) -> Iterator[Any]:
    """The ``vllm`` engine on model A. Its workers also accept callables (``VLLM_ALLOW_INSECURE_SERIALIZATION``,
    test-only): the compat probes run code inside them."""
    from hybridrl.registry import Registry
    from hybridrl.rollout.engines.vllm import CONFIG_KEY

    saved = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    eng = Registry("rollout_engines").build("vllm", {}, key=CONFIG_KEY, model_path=str(vllm_models[0]),
                                            device=torch.device("cpu"))
    yield eng
    eng.shutdown()
    if saved is None:
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = saved
