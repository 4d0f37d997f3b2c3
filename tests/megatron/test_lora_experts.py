"""LoRA on an MoE model's experts: every routed expert and the shared expert get their own adapters, which train, sync
merged into the engine's per-expert weights and export as peft's per-expert modules, the same at EP = 2 and PP = 2 as
on one rank.

The model is a tiny GLM-4.5 (4 layers: a dense first layer, then 4 sigmoid-routed experts top-2 and a shared expert);
``target_modules`` are the MLP projections (``gate_proj``, ``up_proj``, ``down_proj``: peft's names, verl's
``lora.target_modules``). The worker (``workers/lora_step.py``) takes 2 Adam steps of token-mean NLL on a fixed
batch and saves a checkpoint and resumes from it. Time: ~70 s (two torchrun launches).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybridrl.lora.config import LoRAConfig
from hybridrl.lora.peft import write_peft_adapter
from hybridrl.models.tiny import make_tiny_model

WORKER = str(Path(__file__).parent / "workers" / "lora_step.py")
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
           first_k_dense_replace=1, n_group=1, topk_group=1)
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, discriminate: Callable[[Path, int], Path]) -> Path:
    """Routing spread over the experts (router logits ~ N(0, 0.4²), no selection bias): every expert gets tokens."""
    out = discriminate(make_tiny_model(tmp_path_factory.mktemp("lora_moe") / "glm", arch="glm4_moe", hidden=64,
                                       layers=4, heads=4, kv_heads=2, max_positions=128, tie=False, seed=3, moe=MOE), 5)
    state = load_file(out / "model.safetensors")
    for key in [k for k in state if k.endswith("mlp.gate.weight")]:
        state[key] = state[key] * 20
    for key in [k for k in state if k.endswith("e_score_correction_bias")]:
        state[key] = torch.zeros_like(state[key])
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def results(torchrun, model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("lora_moe_step")
    torchrun([WORKER, str(model), str(out), "tp1pp1cp1-mlp"], nproc=1)
    torchrun([WORKER, str(model), str(out), "tp1pp1cp1ep2-mlp", "tp1pp2cp1-mlp"], nproc=2)
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


def _flat(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{k}.{i}": v[i] for k, v in adapters.items() for i in (0, 1)}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp1pp1cp1ep2-mlpdp2", "tp1pp2cp1-mlpdp1"])
def test_expert_adapters_train_the_same_at_ep2_and_pp2(results: dict[str, dict], layout: str) -> None:
    """Each EP rank holds half the experts' adapters (reduced over expert-DP, not all of DP), each stage its layers';
    the gathered adapters, merged weights, log-probs and step metrics equal one rank's, and a checkpoint of them
    resumes bitwise."""
    ref, got = results["tp1pp1cp1-mlpdp1"], results[layout]
    assert got["adapters"].keys() == ref["adapters"].keys()
    worst = max(float((_flat(ref["adapters"])[k] - v).abs().max()) for k, v in _flat(got["adapters"]).items())
    assert worst < 2e-4, worst  # Adam's first steps amplify fp32 reassociation (test_lora_layouts.TOL)
    assert max(float((ref["merged"][k] - v).abs().max()) for k, v in got["merged"].items()) < 1e-5
    assert float((ref["adapted"] - got["adapted"]).abs().max()) < 1e-5
    for a, b in zip(ref["steps"], got["steps"], strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-6
    assert got["only_adapters_trainable"] and got["resumed_bitwise"]
    assert got["in_optimizer"] == got["local_adapter_numel"]
    assert got["trainable_numel"] == ref["trainable_numel"]
    if "ep2" in layout:  # half the routed experts' adapters here, all of the dense and shared ones
        assert got["local_adapter_numel"] < ref["local_adapter_numel"]


@pytest.mark.distributed
def test_every_expert_has_its_own_adapter_and_the_merged_weights_are_the_hf_models(results: dict[str, dict],
                                                                                 model: Path, tmp_path: Path) -> None:
    """An adapter per routed expert and on the shared one, by the checkpoint's names; all of them trained (B left 0);
    the merged weights (what the engine receives) are W + (alpha/r)·B·A per expert, and transformers with them
    gives Megatron's adapted log-probs; the peft folder holds every expert's adapter."""
    ref = results["tp1pp1cp1-mlpdp1"]
    adapters = ref["adapters"]
    for layer in (1, 2, 3):
        for p in MLP:
            for e in range(4):
                assert f"model.layers.{layer}.mlp.experts.{e}.{p}" in adapters
            assert f"model.layers.{layer}.mlp.shared_experts.{p}" in adapters
    assert all(f"model.layers.0.mlp.{p}" in adapters for p in MLP)  # the dense first layer
    assert len(adapters) == 3 + 3 * 3 * 5 and all(float(b.abs().max()) > 0 for _, b in adapters.values())
    base = load_file(model / "model.safetensors")
    a, b = adapters["model.layers.2.mlp.experts.3.up_proj"]
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    assert torch.allclose(ref["merged"][name], base[name] + 2.0 * b @ a, atol=1e-6)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf.load_state_dict(hf_state(hf, ref["merged"]), strict=True)
    logp = torch.zeros_like(ref["adapted"])
    with torch.no_grad():
        for row in range(len(logp)):
            prompt = ref["prompt_ids"][row][ref["prompt_mask"][row] == 1]
            n = int(ref["response_mask"][row].sum())
            ids = torch.cat([prompt, ref["response_ids"][row][:n]])
            logits = hf(input_ids=ids[None]).logits[0].float()
            logp[row, :n] = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, ids[len(prompt):, None])[:, 0]
    assert float((logp - ref["adapted"]).abs().max()) < 2e-5
    write_peft_adapter(adapters, LoRAConfig(rank=4, alpha=8.0, projections=MLP), tmp_path / "adapter",
                       base_model=str(model))
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert "base_model.model.model.layers.3.mlp.experts.0.down_proj.lora_B.weight" in saved
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == sorted(MLP)


def hf_state(hf: torch.nn.Module, merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint-named merged weights in transformers' in-memory layout (its experts fused per layer:
    ``gate_up_proj`` [E, 2F, H] = each expert's [gate; up], ``down_proj`` [E, H, F])."""
    state = dict(hf.state_dict())
    for key in state:
        if key in merged:
            state[key] = merged[key]
        elif key.endswith("mlp.experts.gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            state[key] = torch.stack([torch.cat([merged[f"{prefix}{e}.gate_proj.weight"],
                                                 merged[f"{prefix}{e}.up_proj.weight"]]) for e in range(4)])
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key.removesuffix("down_proj")
            state[key] = torch.stack([merged[f"{prefix}{e}.down_proj.weight"] for e in range(4)])
    return state
