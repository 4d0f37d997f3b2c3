"""A VLM policy on Megatron trains on images: each row's image features and multimodal positions reach the model
in the RL runner's padded micro-batches, log-probs equal transformers', the vision tower trains (or stays frozen
with ``freeze_vision_tower``), is checkpointed and resumed bitwise, and joins the exported weights; TP = 2 takes
the step DP = 2 takes, and the gradient (the tower's too) is transformers'. One torchrun of 2 ranks runs the four
layouts (~35 s: the ranks import Megatron and
transformers once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.tiny_vlm import make_tiny_qwen2_5_vl, make_tiny_qwen3_vl

WORKER = str(Path(__file__).parent / "workers" / "vlm_policy_step.py")


def _moved(exported: dict, start: dict, prefix: str) -> float:
    return max(float((exported[k] - start[k]).abs().max()) for k in exported if k.startswith(prefix))


@pytest.mark.distributed
def test_vision_tower_trains_resumes_and_every_layout_takes_one_step(torchrun, tmp_path: Path) -> None:
    vlm = make_tiny_qwen2_5_vl(tmp_path / "untied", tie=False, seed=3)
    start = load_file(vlm / "model.safetensors")
    torchrun([WORKER, str(vlm), str(tmp_path), "tp1pp1", "tp2pp1", "tp1pp2-frozen", "tp2pp1-sgd"], nproc=2)
    dp2, tp2, pp2 = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("tp1pp1", "tp2pp1",
                                                                                   "tp1pp2-frozen"))
    for r in (dp2, tp2, pp2):
        assert r["logprob_diff"] <= 1e-5  # measured 4.8e-7
    assert dp2["exported"].keys() == start.keys()  # the vision tower's 30 tensors included
    assert _moved(dp2["exported"], start, "visual.") > 1e-3  # lr 1e-2: the tower took the step
    assert dp2["resumed_bitwise"] is True
    assert tp2["step"]["loss"] == pytest.approx(dp2["step"]["loss"], rel=1e-6)
    assert tp2["step"]["grad_norm"] == pytest.approx(dp2["step"]["grad_norm"], rel=1e-5)
    for name, t in dp2["exported"].items():  # Adam's first step is ±lr where gradients are tiny: 1e-3 of it
        update = (t - start[name]).abs().max().clamp_min(1e-8)
        assert float((tp2["exported"][name] - t).abs().max() / update) <= 1e-3, name
    assert _moved(pp2["exported"], start, "visual.") == 0.0  # frozen: sent to the engine unchanged
    assert _moved(pp2["exported"], start, "model.") > 1e-3
    # the gradient itself, the tower's included, is transformers' (an SGD step of lr 1 is minus the gradient)
    sgd = torch.load(tmp_path / "tp2pp1-sgd.pt", weights_only=False)
    grads = sgd["hf_grads"]
    assert {k for k in grads if k.startswith("visual.")} == {k for k in start if k.startswith("visual.")}
    for name, g in grads.items():
        step = start[name] - sgd["exported"][name]  # fp32's rounding of w - g: ~1e-7 of |w|
        assert float((step - g).norm()) <= 1e-4 * float(g.norm()) + 2e-7 * float(start[name].norm()), name


@pytest.mark.distributed
def test_qwen3_vl_gradient_is_transformers_at_cp2_and_pp2(torchrun, tmp_path: Path) -> None:
    """Qwen3-VL (interleaved M-RoPE, DeepStack after decoder layers 0 and 1): at CP = 2 each rank places the features
    in the whole row and keeps its chunks (DeepStack's rows too) — the SGD step is minus transformers' gradient, the
    tower's and the DeepStack mergers' included; at PP = 2 the log-probs are transformers'. ~20 s."""
    vlm = make_tiny_qwen3_vl(tmp_path / "qwen3", tie=True, seed=3)
    start = load_file(vlm / "model.safetensors")
    torchrun([WORKER, str(vlm), str(tmp_path), "tp1pp1cp2-sgd", "tp1pp2"], nproc=2)
    sgd, pp2 = (torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("tp1pp1cp2-sgd", "tp1pp2"))
    assert sgd["logprob_diff"] <= 1e-5 and pp2["logprob_diff"] <= 1e-5
    assert sgd["exported"].keys() == start.keys()  # model.language_model.*, model.visual.*: the checkpoint's names
    grads = sgd["hf_grads"]
    assert any(k.startswith("model.visual.deepstack_merger_list.") for k in grads)
    assert {k for k in grads if k.startswith("model.visual.")} == {k for k in start if k.startswith("model.visual.")}
    for name, g in grads.items():
        step = start[name] - sgd["exported"][name]
        assert float((step - g).norm()) <= 1e-4 * float(g.norm()) + 2e-7 * float(start[name].norm()), name
