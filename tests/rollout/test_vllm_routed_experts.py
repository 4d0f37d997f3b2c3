"""The vllm engine's R3 rows (GPU only, so the engine itself is not started here): vLLM's ``routed_experts`` of a
finished sample become ``Generation.routed_experts`` — int16, one row per position run (prompt + output − 1), the MoE
layers only when vLLM gives a row to every layer — and a wrong shape is an error, not a silently misaligned replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridrl.rollout.engines.vllm import VLLMEngineError, VLLMRolloutEngine


def engine(moe_layers: list[int]) -> VLLMRolloutEngine:
    e = object.__new__(VLLMRolloutEngine)  # the conversion reads only which layers are MoE layers
    e.moe_layers = moe_layers
    e.describe = lambda: "test"  # type: ignore[method-assign]
    return e


def test_rows_become_int16_moe_rows() -> None:
    rows = np.arange(5 * 3 * 2).reshape(5, 3, 2).astype(np.int32)  # 5 positions, 3 layers, top-2
    out = engine([0, 1, 2])._routed_experts(rows, positions=5)
    assert out.dtype == torch.int16 and torch.equal(out, torch.as_tensor(rows).to(torch.int16))
    dense_first = engine([1, 2])._routed_experts(rows, positions=5)  # layer 0 dense (DeepSeek-V3's first_k_dense)
    assert torch.equal(dense_first, torch.as_tensor(rows[:, 1:]).to(torch.int16))


def test_misaligned_rows_are_refused() -> None:
    rows = np.zeros((4, 2, 2), dtype=np.int32)
    with pytest.raises(VLLMEngineError, match=r"shape \(4, 2, 2\); expected \[5 positions"):
        engine([0, 1])._routed_experts(rows, positions=5)
    with pytest.raises(VLLMEngineError, match="cover 2 layers; the model.s MoE layers are \\[1, 3, 5\\]"):
        engine([1, 3, 5])._routed_experts(rows, positions=4)
    with pytest.raises(VLLMEngineError, match="no routed experts"):
        engine([0])._routed_experts(None, positions=4)
