"""``use_cpu_in_p2p_shape_exchange`` (hybridrl/megatron/cpu/model.py) is still needed and does its job:
pipeline stages exchange activations of varying shapes (token-budget micro-batches) on gloo."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).parent / "workers" / "p2p_shapes.py"


@pytest.mark.distributed
def test_variable_shape_exchange_still_fails_upstream_and_works_adapted(torchrun: Any, tmp_path: Path) -> None:
    torchrun([str(WORKER), str(tmp_path)], nproc=2, timeout=240)
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # stage 0 hits the unconditional torch.cuda.synchronize() after sending the first shape
    assert first["without"] == "AssertionError: Torch not compiled with CUDA enabled"
    assert second["with"] == [[3, 1, 2], [5, 2, 2]]  # both shapes arrived, the second unlike the first
