"""MoE checkpoints (Qwen3-MoE, Qwen2-MoE) in Megatron's MoE layers: the architecture read from config.json
(``hybridrl/hf/arch.py``), its layout rules, and ``hybridrl verify-model`` — logits against transformers and a
bitwise round trip — at TP=1, TP=2, EP=2, TP=2×EP=2 and TP=2 with EP=2 over the TP ranks (ETP=1) on shapes the
layouts were not tuned on: odd expert counts, top-k 3, dense layers among the MoE ones (``mlp_only_layers``,
``decoder_sparse_step``), ``norm_topk_prob`` both ways, Qwen2-MoE's gated shared expert, tied and untied
embeddings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridrl.hf.arch import HFArch
from hybridrl.megatron.config import MegatronConfig, layout_problems
from hybridrl.megatron.verify import run_verification
from hybridrl.models.tiny import make_tiny_model

KW = dict(hidden=32, heads=4, kv_heads=2, intermediate=40, max_positions=64)
MODELS = {  # name: (arch, layers, tie, moe keys)
    # 5 experts (odd), top-3, layer 1 dense, weights not renormalised
    "q3_odd": ("qwen3_moe", 3, True, dict(num_experts=5, num_experts_per_tok=3, moe_intermediate_size=16,
                                          mlp_only_layers=[1], norm_topk_prob=False)),
    # every second layer sparse (decoder_sparse_step=2), renormalised top-2 of 3
    "q3_step": ("qwen3_moe", 4, False, dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=8,
                                            decoder_sparse_step=2, norm_topk_prob=True)),
    # the gated shared expert, 3 experts
    "q2_shared": ("qwen2_moe", 2, False, dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=16,
                                              shared_expert_intermediate_size=24, norm_topk_prob=True)),
    # EP=2 needs an even expert count: 6 experts top-3 with a dense layer; 4 with a shared expert
    "q3_even": ("qwen3_moe", 2, True, dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16,
                                           mlp_only_layers=[0], norm_topk_prob=True)),
    "q2_even": ("qwen2_moe", 2, False, dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=24)),
}
LAYOUTS = {  # tp, pp, ep, etp (null: tp), models
    "tp1": (1, 1, 1, None, ["q3_odd", "q3_step", "q2_shared"]),
    "tp2": (2, 1, 1, None, ["q3_odd", "q3_step", "q2_shared"]),
    "ep2": (1, 1, 2, None, ["q3_even", "q2_even"]),
    "tp2ep2": (2, 1, 2, None, ["q3_even", "q2_even"]),  # PP=2×EP=2 was exact too (by hand; 20 s of CI saved)
    # verl's MoE grid (TP=2 × EP=8, ETP=1) in small: whole experts, EP over the 2 TP ranks; the shared expert at TP
    "tp2etp1ep2": (2, 1, 2, 1, ["q3_even", "q2_even"]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("moe")
    out = {}
    for i, (name, (arch, layers, tie, moe)) in enumerate(MODELS.items()):
        path = make_tiny_model(tmp / name, arch=arch, layers=layers, tie=tie, moe=moe, seed=i, **KW)  # type: ignore[arg-type]
        state = load_file(path / "model.safetensors")  # decisive routing: top-k never near a tie
        for key in [k for k in state if k.endswith("mlp.gate.weight")]:
            state[key] = state[key] * 25
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
        out[name] = path
    return out


def test_the_architecture_of_each_family_is_read_from_config_json(models: dict[str, Path]) -> None:
    odd = HFArch.from_hf(models["q3_odd"])
    assert (odd.family, odd.qk_layernorm, odd.qkv_bias) == ("qwen3_moe", True, False)
    assert odd.moe is not None and (odd.moe.num_experts, odd.moe.top_k, odd.moe.ffn_hidden_size) == (5, 3, 16)
    assert odd.moe.sparse_layers == (True, False, True) and odd.moe.norm_topk_prob is False
    step = HFArch.from_hf(models["q3_step"]).moe
    assert step is not None and step.sparse_layers == (False, True, False, True)  # (i + 1) % 2 == 0
    shared = HFArch.from_hf(models["q2_shared"])
    assert (shared.family, shared.qkv_bias, shared.qk_layernorm) == ("qwen2_moe", True, False)
    assert shared.moe is not None and (shared.moe.shared_ffn_hidden_size, shared.moe.shared_expert_gate) == (24, True)
    # the older key name of the expert count (transformers < 5: num_experts) reads the same
    cfg = {**__import__("json").loads((models["q3_odd"] / "config.json").read_text())}
    cfg["num_experts"] = cfg.pop("num_local_experts", cfg.get("num_experts"))
    assert HFArch.from_hf(cfg).moe == odd.moe


def test_bad_moe_values_name_their_key(models: dict[str, Path]) -> None:
    cfg = __import__("json").loads((models["q3_odd"] / "config.json").read_text())
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds"):
        HFArch.from_hf({**cfg, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[7\] must be a list of layer indices in \[0, 3\)"):
        HFArch.from_hf({**cfg, "mlp_only_layers": [7]})


def test_expert_parallel_sizes_that_do_not_fit_are_refused_naming_the_key(models: dict[str, Path]) -> None:
    odd = HFArch.from_hf(models["q3_odd"])
    [(key, value, message)] = odd.split_problems(tp=1, pp=1, ep=2)
    assert (key, value) == ("expert_model_parallel_size", 2) and "5 experts" in message and "[1, 5]" in message
    assert any("moe_intermediate_size=16" in m for _, _, m in odd.split_problems(tp=32, pp=1))
    dense = HFArch.from_hf(make_tiny_model(models["q3_odd"].parent / "dense", arch="qwen3", layers=2, **KW))
    assert "dense" in dense.split_problems(tp=1, pp=1, ep=2)[0][2]
    # Megatron takes the expert ranks from the data-parallel ones: EP must divide world / (TP·PP)
    found = layout_problems(MegatronConfig(tensor_model_parallel_size=2, expert_model_parallel_size=4),
                            world_size=4)
    assert [(k, v) for k, v, _ in found] == [("expert_model_parallel_size", 4)] and "valid: [1, 2]" in found[0][2]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_verify_model_is_exact_for_moe_checkpoints(models: dict[str, Path], layout: str) -> None:
    """Logits ≤ 1e-4 of transformers' (fp32) and every exported tensor bit-identical to the checkpoint's.
    ~15–30 s per layout: one launch of its ranks (4 for TP=2×EP=2) checks its models."""
    tp, pp, ep, etp, names = LAYOUTS[layout]
    reports = run_verification([models[n] for n in names], tp=tp, pp=pp, ep=ep, etp=etp, bucket_bytes=20_000)
    for name, r in zip(names, reports, strict=True):
        assert r.max_abs_logit_diff <= 1e-4, (layout, name, r)
        assert r.roundtrip_exact, (layout, name, r.mismatches)
        assert r.n_tensors == len(load_file(models[name] / "model.safetensors")), (layout, name)


def test_the_router_without_transformer_engine_still_needs_its_adaptation() -> None:
    """``hybridrl/megatron/moe_compat.py`` item 1: without TE, megatron-core's router linear reads an unbound
    ``te_general_gemm``; the adaptation binds it to None (the torch path). Fails once upstream binds it."""
    from megatron.core.transformer.moe import moe_utils

    from hybridrl.megatron.moe_compat import apply_moe_adaptations

    if moe_utils.HAVE_TE:
        pytest.skip("Transformer Engine is installed: the name is bound upstream")
    saved = moe_utils.__dict__.pop("te_general_gemm", None)
    x, w = torch.randn(3, 4), torch.randn(2, 4)
    try:
        with pytest.raises(NameError, match="te_general_gemm"):
            moe_utils.router_gating_linear(x, w, None, torch.float32)
        apply_moe_adaptations()
        torch.testing.assert_close(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.t())
    finally:
        moe_utils.te_general_gemm = saved


def test_a_chained_optimizer_with_an_empty_part_still_needs_it_dropped() -> None:
    """``moe_compat`` item 3: a chain whose dense part has no trainable parameters (LoRA on the experts of an all-MoE
    model) holds a stub part (``optimizer`` None), and the chain's step sync — run by every checkpoint save — reads
    its param groups. Dropped, the real part syncs alone. Fails once upstream skips stub parts (the item can go).
    The chain is Megatron's class with two parts standing in for its optimizers (only their ``optimizer`` is read)."""
    from types import SimpleNamespace

    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from hybridrl.megatron.moe_compat import drop_empty_parts

    adam = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])
    adam.param_groups[0]["step"] = 3
    chain = ChainedOptimizer.__new__(ChainedOptimizer)
    chain.chained_optimizers = [SimpleNamespace(optimizer=None), SimpleNamespace(optimizer=adam)]
    with pytest.raises(AttributeError, match="param_groups"):
        chain._synchronize_steps()
    assert drop_empty_parts(chain) == 1 and [p.optimizer for p in chain.chained_optimizers] == [adam]
    chain._synchronize_steps()
    assert adam.param_groups[0]["step"] == 3
    assert drop_empty_parts(chain) == 0


def test_the_plan_shows_the_expert_layout_and_refuses_one_that_does_not_split(models: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    from hybridrl.config.compose import compose_config
    from hybridrl.config.errors import ConfigError
    from hybridrl.config.validate import validate

    base = ["recipe=grpo_tiny", f"actor_rollout_ref.model.path={models['q3_even']}",
            "actor_rollout_ref.model.build_if_missing=null", f"trainer.output_dir={tmp_path / 'out'}"]
    # the recipe's data is built on a run's first use (build_if_missing), as `hybridrl validate` allows for
    text = validate(compose_config([*base, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"]),
                    world_size=2, before_bootstrap=True).render()
    assert "actor   TP=1 PP=1 CP=1 DP=2 EP=2" in text
    assert "experts 6 per MoE layer (1 of 2 layers), top-3, 16 wide; EP=2: 3 experts per rank" in text
    with pytest.raises(ConfigError) as e:
        validate(compose_config([*base, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=4"]),
                 world_size=4, before_bootstrap=True)
    [issue] = [i for i in e.value.issues if i.key.endswith("expert_model_parallel_size")]
    assert "6 experts" in str(issue)


def test_engines_that_cannot_serve_the_moe_model_here_are_refused_before_any_model(models: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    """The engine's own ``model_problem`` reaches validation at ``rollout.name``: SGLang's CPU MoE path
    (sglang_compat item 10), and vLLM's CPU attention with these models' head_dim 8 (vllm_compat item 7); hf serves
    them."""
    from hybridrl.config.compose import compose_config
    from hybridrl.config.errors import ConfigError
    from hybridrl.config.validate import validate

    base = ["recipe=grpo_tiny", f"actor_rollout_ref.model.path={models['q3_odd']}",
            "actor_rollout_ref.model.build_if_missing=null", f"trainer.output_dir={tmp_path / 'out'}"]
    for engine, says in (("sglang", "an MoE model (5 experts): SGLang 0.5.21's CPU MoE path"),
                         ("vllm", "head_dim=8: vLLM's CPU attention supports head_dim 32")):
        with pytest.raises(ConfigError) as e:
            validate(compose_config([*base, f"actor_rollout_ref.rollout.name={engine}"]), world_size=1,
                     before_bootstrap=True)
        [issue] = [i for i in e.value.issues if i.key == "actor_rollout_ref.rollout.name"]
        assert says in str(issue), str(issue)
    validate(compose_config(base), world_size=1, before_bootstrap=True)


def test_an_expert_grid_of_its_own_is_planned_and_refused_naming_the_key(models: dict[str, Path]) -> None:
    """``expert_tensor_parallel_size`` (Megatron's ETP; verl's MoE scripts set 1): at ETP < TP the experts take EP ×
    ETP of a stage's TP×CP×DP ranks — verl's TP=2 × EP=8 on 8 GPUs, which at ETP = TP would need 16."""
    grid = MegatronConfig(tensor_model_parallel_size=2, expert_model_parallel_size=8, expert_tensor_parallel_size=1)
    assert layout_problems(grid, world_size=8) == []
    assert [k for k, _, _ in layout_problems(MegatronConfig(tensor_model_parallel_size=2,
                                                            expert_model_parallel_size=8), world_size=8)] == [
        "expert_model_parallel_size"]
    [(key, value, message)] = layout_problems(grid, world_size=4)
    assert (key, value) == ("expert_model_parallel_size", 8) and "EP×ETP = 8×1" in message and "[1, 2, 4]" in message
    odd = HFArch.from_hf(models["q3_odd"])  # moe_intermediate_size 16: whole at ETP=1, split at ETP=2
    assert not [p for p in odd.split_problems(tp=2, pp=1, etp=1) if p[0] == "expert_tensor_parallel_size"]
    assert "moe_intermediate_size=16" in odd.split_problems(tp=1, pp=1, etp=32)[0][2]
