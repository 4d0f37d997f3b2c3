"""LoRA on the Megatron policy: the same adapters after a step at every layout, and exactly peft's adapters.

The worker (``workers/lora_step.py``) takes 2 Adam steps of token-mean NLL with LoRA (rank 4) on a fixed batch.
Compared with the single-rank run: the full adapters (A and B of every HF projection) after the steps, the merged
HF weights the engine would receive, and the base / adapted log-probs, at TP=2, PP=2, DP=2, CP=2, VPP=2 and
with the distributed optimizer; then the TP=2 adapters are written as a peft folder and loaded by ``peft`` onto
the HF base, whose log-probs must equal Megatron's adapted ones (this checks the fused q/k/v and gate/up layout).

Slow (1.5–3 min on 2 shared cores): two torchrun launches (Megatron's import costs ~15 s per launch).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hybridrl.lora.config import LoRAConfig
from hybridrl.lora.peft import write_peft_adapter
from hybridrl.models.tiny import make_tiny_model

WORKER = str(Path(__file__).parent / "workers" / "lora_step.py")
TWO_RANKS = ["tp2pp1cp1", "tp1pp2cp1", "tp1pp1cp1", "tp1pp1cp2", "tp1pp2cp1vpp2", "tp1pp1cp1-distopt",
             "tp2pp1cp1-qv"]
# fp32 reassociation only. Adam's first steps divide by |g| + eps (1e-6), which amplifies that noise on
# near-zero gradient entries (A's gradient is exactly 0 on step 1, since B = 0): seen ≤ 5e-5 on adapters
# (whose entries are ~0.02–0.13), ≤ 2e-6 on merged weights, ≤ 1e-6 on log-probs.
# logprobs: 1e-5 (≈ 2.5e-6 relative at log p ≈ -4): TP=2's split reductions round differently from one rank, by
# 5.2e-6 on an AVX-512 CPU (under 5e-6 on the AVX2 build machines)
TOL = {"adapters": 2e-4, "merged": 1e-5, "logprobs": 1e-5}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, discriminate: Callable[[Path, int], Path]) -> Path:
    """4 layers (2 per stage at PP=2), 4 heads / 2 KV groups (1 per rank at TP=2), QKV bias, tied embeddings."""
    out = tmp_path_factory.mktemp("lora") / "tiny-qwen2"
    make_tiny_model(out, arch="qwen2", hidden=64, layers=4, heads=4, kv_heads=2, max_positions=128, tie=True, seed=3)
    return discriminate(out, 3)


@pytest.fixture(scope="module")
def results(torchrun, model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("lora_step")
    torchrun([WORKER, str(model), str(out), "tp1pp1cp1", "tp1pp1cp1-qv"], nproc=1)
    torchrun([WORKER, str(model), str(out), *TWO_RANKS], nproc=2)
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", TWO_RANKS)
def test_lora_step_matches_one_rank(results: dict[str, dict], layout: str) -> None:
    dp = 2 if layout.startswith("tp1pp1cp1") else 1
    got = results[f"{layout}dp{dp}"]
    ref = results["tp1pp1cp1-qvdp1" if layout.endswith("-qv") else "tp1pp1cp1dp1"]
    flat = {f"{k}.{i}": v[i] for k, v in ref["adapters"].items() for i in (0, 1)}
    assert _max_diff(flat, {f"{k}.{i}": v[i] for k, v in got["adapters"].items() for i in (0, 1)}) < TOL["adapters"]
    assert _max_diff(ref["merged"], got["merged"]) < TOL["merged"]
    for key in ("base_before", "base_after", "adapted"):
        assert float((ref[key] - got[key]).abs().max()) < TOL["logprobs"], key
    for a, b in zip(ref["steps"], got["steps"], strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-6
    # only the adapters train, and only they are in the optimizer (the distributed one shards them over DP)
    assert got["only_adapters_trainable"]
    assert got["in_optimizer"] == got["local_adapter_numel"] // (dp if layout.endswith("-distopt") else 1)
    assert got["trainable_numel"] == ref["trainable_numel"]
    # its checkpoint state (adapters only + optimizer) restored into a fresh policy takes the same next step
    assert got["resumed_bitwise"] and ref["resumed_bitwise"]


@pytest.mark.distributed
def test_lora_trains_adapters_only(results: dict[str, dict]) -> None:
    ref = results["tp1pp1cp1dp1"]
    assert torch.equal(ref["base_before"], ref["base_after"])  # the frozen base did not move
    assert float((ref["adapted"] - ref["base_after"]).abs().max()) > 0.1  # the adapters did
    assert ref["steps"][1]["loss"] < ref["steps"][0]["loss"]
    # Σ r·(in + out) over the adapted projections: rank 4 × 4 layers × (q: 64→64, v: 64→32 = 2 KV groups × 16)
    assert results["tp1pp1cp1-qvdp1"]["trainable_numel"] == 4 * 4 * ((64 + 64) + (64 + 32))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2pp1cp1dp1", "tp2pp1cp1-qvdp1"])
def test_peft_adapter_reproduces_megatron(results: dict[str, dict], model: Path, tmp_path: Path, layout: str) -> None:
    """peft (0.21.2) loads the exported adapter onto the HF base; its log-probs equal Megatron's adapted ones within
    2e-5 (fp32; TP=2 run), and its merged weights (merge_and_unload) equal the engine's merged ones within 1e-6."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    got = results[layout]
    targets = ("q_proj", "v_proj") if "-qv" in layout else ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj")
    write_peft_adapter(got["adapters"], LoRAConfig(rank=4, alpha=8.0, projections=targets), tmp_path / "adapter",
                       base_model=str(model))
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    logp = torch.zeros_like(got["adapted"])
    with torch.no_grad():
        for b in range(len(logp)):
            prompt = got["prompt_ids"][b][got["prompt_mask"][b] == 1]
            n = int(got["response_mask"][b].sum())
            ids = torch.cat([prompt, got["response_ids"][b][:n]])
            logits = peft_model(input_ids=ids[None]).logits[0].float()
            logp[b, :n] = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, ids[len(prompt):, None])[:, 0]
    diff = float((logp - got["adapted"]).abs().max())
    merged = peft_model.merge_and_unload().state_dict()
    merged_diff = max(float((merged[name] - tensor).abs().max()) for name, tensor in got["merged"].items())
    print(f"{layout}: peft vs Megatron log-probs {diff:.2g}, merged weights {merged_diff:.2g}")
    assert diff < 2e-5 and merged_diff < 1e-6
