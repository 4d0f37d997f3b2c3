"""A VLM policy on Megatron trains on images: each row's image features and multimodal positions reach the model
in the RL runner's padded micro-batches, log-probs equal transformers', the vision tower trains (or stays frozen
with ``freeze_vision_tower``), is checkpointed and resumed bitwise, and joins the exported weights; TP = 2 takes
one rank's step. Each layout is one torchrun of the worker (~20 s: its ranks import Megatron and transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.tiny_vlm import make_tiny_qwen2_5_vl

WORKER = str(Path(__file__).parent / "workers" / "vlm_policy_step.py")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vlm_policy") / "untied", tie=False, seed=3)


def _run(torchrun, vlm: Path, out: Path, tp: int, pp: int, *flags: str) -> dict:
    torchrun([WORKER, str(vlm), str(out), str(tp), str(pp), *flags], nproc=tp * pp)
    return torch.load(out, weights_only=False)


def _moved(exported: dict, start: dict, prefix: str) -> float:
    return max(float((exported[k] - start[k]).abs().max()) for k in exported if k.startswith(prefix))


@pytest.mark.distributed
def test_vision_tower_trains_and_tp2_takes_one_ranks_step(torchrun, vlm: Path, tmp_path: Path) -> None:
    start = load_file(vlm / "model.safetensors")
    one = _run(torchrun, vlm, tmp_path / "tp1.pt", 1, 1)
    assert float((one["before"] - one["hf"]).abs().max()) <= 1e-5  # measured 4.8e-7
    assert one["exported"].keys() == start.keys()  # the vision tower's 30 tensors included
    assert _moved(one["exported"], start, "visual.") > 1e-3  # lr 1e-2: the tower took the step
    assert one["resumed_bitwise"] is True
    two = _run(torchrun, vlm, tmp_path / "tp2.pt", 2, 1)
    assert float((two["before"] - two["hf"]).abs().max()) <= 1e-5
    assert two["step"]["loss"] == pytest.approx(one["step"]["loss"], rel=1e-6)
    assert two["step"]["grad_norm"] == pytest.approx(one["step"]["grad_norm"], rel=1e-5)
    for name, t in one["exported"].items():  # Adam's first step is ±lr where gradients are tiny: 1e-3 of it
        update = (t - start[name]).abs().max().clamp_min(1e-8)
        assert float((two["exported"][name] - t).abs().max() / update) <= 1e-3, name


@pytest.mark.distributed
def test_frozen_vision_tower_at_pp2(torchrun, vlm: Path, tmp_path: Path) -> None:
    start = load_file(vlm / "model.safetensors")
    out = _run(torchrun, vlm, tmp_path / "pp2.pt", 1, 2, "frozen")
    assert float((out["before"] - out["hf"]).abs().max()) <= 1e-5
    assert _moved(out["exported"], start, "visual.") == 0.0  # sent to the engine unchanged
    assert _moved(out["exported"], start, "model.") > 1e-3
