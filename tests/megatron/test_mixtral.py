"""Mixtral (HF ``MixtralForCausalLM``) in Megatron's MoE layers: config.json read as every layer's MLP the MoE
(softmax top-k, the top-k weights renormalised, experts of ``intermediate_size``, no shared expert), the checkpoint's
``block_sparse_moe.gate`` / ``block_sparse_moe.experts.<e>.{w1,w3,w2}`` names, and ``hybridrl verify-model`` — logits
against transformers and a bitwise round trip — at TP=1, TP=2 and EP=2, on a shape the Qwen MoE tests do not use
(4 experts, top-2, hidden 48, 3 layers, 6 heads over 2 KV groups, experts 40 wide, untied embeddings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hybridrl.hf.arch import HFArch
from hybridrl.megatron.convert import all_units
from hybridrl.megatron.verify import run_verification
from hybridrl.models.tiny import make_tiny_model

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "ep2": (1, 2)}  # tp, ep


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("mixtral") / "m", arch="mixtral", hidden=48, layers=3, heads=6,
                           kv_heads=2, intermediate=40, max_positions=64, tie=False, seed=7,
                           moe=dict(num_local_experts=4, num_experts_per_tok=2))
    state = load_file(path / "model.safetensors")  # decisive routing: top-k never near a tie
    for key in [k for k in state if k.endswith("block_sparse_moe.gate.weight")]:
        state[key] = state[key] * 25
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_the_architecture_is_read_from_config_json(mixtral: Path) -> None:
    arch = HFArch.from_hf(mixtral)
    assert (arch.family, arch.qkv_bias, arch.qk_layernorm, arch.num_query_groups) == ("mixtral", False, False, 2)
    assert arch.moe is not None
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.ffn_hidden_size, arch.moe.norm_topk_prob) == (4, 2, 40, True)
    assert arch.moe.sparse_layers == (True, True, True) and arch.moe.shared_ffn_hidden_size == 0
    # every checkpoint tensor is some unit's, by the checkpoint's own names
    on_disk = set(load_file(mixtral / "model.safetensors"))
    assert on_disk == {n for u in all_units(arch) for n in u.hf_names}
    assert "model.layers.2.block_sparse_moe.experts.3.w3.weight" in on_disk


def test_what_megatron_does_not_model_is_refused_naming_the_key(mixtral: Path) -> None:
    cfg = json.loads((mixtral / "config.json").read_text())
    with pytest.raises(NotImplementedError, match="sliding_window=4096 is not supported; valid: None"):
        HFArch.from_hf({**cfg, "sliding_window": 4096})
    with pytest.raises(NotImplementedError, match="router_jitter_noise=0.01 is not supported"):
        HFArch.from_hf({**cfg, "router_jitter_noise": 0.01})
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds num_local_experts=4"):
        HFArch.from_hf({**cfg, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match=r"\['norm_topk_prob'\] are not Mixtral config keys"):
        make_tiny_model(mixtral.parent / "bad", arch="mixtral", moe=dict(norm_topk_prob=False))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_verify_model_is_exact_for_mixtral(mixtral: Path, layout: str) -> None:
    """Logits ≤ 1e-4 of transformers' (fp32) and every exported tensor bit-identical to the checkpoint's.
    ~15–25 s per layout: one launch of its 1 or 2 ranks."""
    tp, ep = LAYOUTS[layout]
    [r] = run_verification([mixtral], tp=tp, ep=ep, bucket_bytes=20_000)
    print(f"mixtral {layout}: max_abs_logit_diff={r.max_abs_logit_diff:.3g}")
    assert r.max_abs_logit_diff <= 1e-4, (layout, r)
    assert r.roundtrip_exact, (layout, r.mismatches)
    assert r.n_tensors == len(load_file(mixtral / "model.safetensors")), layout
