"""DeepSeek-V3 (HF ``DeepseekV3ForCausalLM``; Moonlight's too) in Megatron: GLM-4.5's sigmoid-routed MoE layers
(``hf.arch._sigmoid_moe``) under multi-latent attention (Megatron's ``MLASelfAttention``, ``hf.mla.MLA``), the query
through a LoRA (``q_a_proj``/``q_a_layernorm``/``q_b_proj``) or one ``q_proj`` (``q_lora_rank`` null);
``hybridrl verify-model`` — logits against transformers and a bitwise round trip — at TP=1, TP=2 and EP=2, both
checkpoints in one launch each, and on uneven pipeline stages (PP=2 as 1 + 2 and 2 + 1 layers); what Megatron's MLA
computes otherwise is refused naming the key; the hf rollout engine serves it as transformers does and takes a weight
swap; the two local-spec adaptations MLA needs (``hybridrl.megatron.cpu``) are still needed.

The checkpoints: hidden 48, 3 layers (layer 0 dense, 40 wide), 4 heads of nope 16 + rope 8 (values 16), kv_lora_rank
24, 8 experts in 2 groups (1 chosen), top-2, a shared expert, experts 16 wide, untied embeddings, no RoPE scaling; one
made by the CLI with ``q_lora_rank`` 32, one by :func:`make_tiny_model` with ``q_lora_rank`` null. Both are made
discriminating (tests/conftest.py: norms redrawn, which a misplaced latent norm would show) with the q and kv
projections ×8 (peaked attention, which a wrong rope layout or softmax scale would show: checked below) and the routers
×10 (the bias and the groups decide the experts, as in test_glm4_moe.py)."""

from __future__ import annotations

import inspect
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybridrl.cli import main as cli
from hybridrl.hf.arch import HFArch
from hybridrl.interfaces import RolloutEngine
from hybridrl.megatron.convert import all_units
from hybridrl.models.tiny import make_tiny_model

SHAPE = dict(hidden=48, layers=3, heads=4, intermediate=40, max_positions=64, seed=5)
SHARPENED = ("q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")


def _sharpen(path: Path) -> Path:
    """q and kv projections ×8 (attention far from uniform), routers ×10 (sigmoid scores spread, no near-ties)."""
    state = load_file(path / "model.safetensors")
    for key in state:
        if key.endswith(SHARPENED):
            state[key] = state[key] * 8
        elif key.endswith("mlp.gate.weight"):
            state[key] = state[key] * 10
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory: pytest.TempPathFactory, discriminate: Callable[[Path, int], Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    lora = root / "q_lora"
    assert cli(["make-tiny-model", str(lora), "--arch", "deepseek_v3", "--no-tie", "--moe", "moe_intermediate_size=16",
                *(f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items())]) == 0
    plain = make_tiny_model(root / "q_proj", arch="deepseek_v3", tie=False,
                            moe=dict(moe_intermediate_size=16, q_lora_rank=None), **SHAPE)
    yarn = make_tiny_model(root / "yarn", arch="deepseek_v3", tie=False, moe=dict(moe_intermediate_size=16), **SHAPE)
    config = json.loads((yarn / "config.json").read_text())
    config["rope_parameters"] = YARN  # past position 4 the context is "extended": every frequency band in use
    (yarn / "config.json").write_text(json.dumps(config, indent=2))
    for seed, path in enumerate((lora, plain, yarn)):
        _sharpen(discriminate(path, seed))
    return {"q_lora": lora, "q_proj": plain, "yarn": yarn}


# DeepSeek-V3's own rope_scaling (factor 40, mscale = mscale_all_dim = 1 over 4096 positions), scaled to a tiny context
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 4,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_the_architecture_is_read_from_config_json(dsv3: dict[str, Path]) -> None:
    arch = HFArch.from_hf(dsv3["q_lora"])
    mla = arch.mla
    assert arch.family == "deepseek_v3" and mla is not None
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (
        32, 24, 16, 8, 16)
    assert HFArch.from_hf(dsv3["q_proj"]).mla.q_lora_rank is None  # type: ignore[union-attr]
    moe = arch.moe
    assert moe is not None and moe.sparse_layers == (False, True, True)
    assert (moe.num_experts, moe.top_k, moe.shared_ffn_hidden_size, moe.num_groups, moe.group_topk,
            moe.scaling_factor) == (8, 2, 16, 2, 1, 2.5)
    for name, path in dsv3.items():  # every checkpoint tensor is some unit's, by the checkpoint's own names
        on_disk = set(load_file(path / "model.safetensors"))
        assert on_disk == {n for u in all_units(HFArch.from_hf(path)) for n in u.hf_names}, name
    assert {"model.layers.1.self_attn.q_proj.weight", "model.layers.2.self_attn.kv_b_proj.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias"} <= set(load_file(dsv3["q_proj"] / "model.safetensors"))
    assert HFArch.from_hf(dsv3["yarn"]).mla.yarn == (8.0, 4, 32.0, 1.0, 1.0, 1.0)  # type: ignore[union-attr]


def test_the_rope_layout_and_the_latent_norms_show_in_the_logits(dsv3: dict[str, Path]) -> None:
    """Else the logit check below would pass with them wrong: transformers' own logits move by far more than 1e-4
    when it rotates the rope dims as halves instead of interleaved pairs, or drops the kv latent's norm weight."""
    model = AutoModelForCausalLM.from_pretrained(dsv3["q_lora"], dtype=torch.float32).eval()
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        model.config.rope_interleave = False
        halves = model(input_ids=ids).logits
        model.config.rope_interleave = True
        for layer in model.model.layers:
            layer.self_attn.kv_a_layernorm.weight.fill_(1.0)
        unnormed = model(input_ids=ids).logits
    assert (want - halves).abs().max() > 1e-2
    assert (want - unnormed).abs().max() > 1e-2
    # YaRN's frequencies and its softmax mscale² move them as much (the yarn checkpoint with plain RoPE)
    model = AutoModelForCausalLM.from_pretrained(dsv3["yarn"], dtype=torch.float32).eval()
    config = json.loads((dsv3["yarn"] / "config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(dsv3["yarn"], dtype=torch.float32, config=type(model.config)(**{
        **config, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})).eval()
    with torch.no_grad():
        assert (model(input_ids=ids).logits - plain(input_ids=ids).logits).abs().max() > 1e-2


def test_what_megatron_does_not_model_is_refused_naming_the_key(dsv3: dict[str, Path]) -> None:
    cfg = json.loads((dsv3["q_lora"] / "config.json").read_text())
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(NotImplementedError, match=r"rope_parameters.rope_type='linear' is not supported for "
                                                  r"deepseek_v3; valid: 'default', 'yarn'"):
        HFArch.from_hf({**cfg, "rope_parameters": linear})
    with pytest.raises(NotImplementedError, match="rope_interleave=False is not supported; valid: true"):
        HFArch.from_hf({**cfg, "rope_interleave": False})
    with pytest.raises(NotImplementedError, match="num_key_value_heads=2 is not supported for deepseek_v3; valid: "
                                                  "num_attention_heads=4"):
        HFArch.from_hf({**cfg, "num_key_value_heads": 2})
    with pytest.raises(NotImplementedError, match="rms_norm_eps=1e-05 is not supported for deepseek_v3"):
        HFArch.from_hf({**cfg, "rms_norm_eps": 1e-5})
    with pytest.raises(NotImplementedError, match="attention_bias=True is not supported"):
        HFArch.from_hf({**cfg, "attention_bias": True})
    with pytest.raises(NotImplementedError, match=r"topk_group=2 with num_experts_per_tok=2 and n_group=4"):
        HFArch.from_hf({**cfg, "n_group": 4, "topk_group": 2})
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3: must divide the model's q_lora_rank=32"):
        HFArch.from_hf({**cfg, "num_attention_heads": 6, "num_key_value_heads": 6}).check_split(tp=3, pp=1)
    with pytest.raises(ValueError, match=r"\['num_experts'\] are not DeepSeek-V3 config keys"):
        make_tiny_model(dsv3["q_lora"].parent / "bad", arch="deepseek_v3", moe=dict(num_experts=4))
    # absent routing keys read as DeepseekV3Config's defaults (GLM-4.5's differ)
    bare = {k: v for k, v in cfg.items() if k not in ("n_group", "topk_group", "first_k_dense_replace")}
    moe = HFArch.from_hf({**bare, "num_hidden_layers": 4, "num_experts_per_tok": 8, "n_routed_experts": 16}).moe
    assert moe is not None and (moe.num_groups, moe.group_topk, moe.sparse_layers) == (8, 4, (False,) * 3 + (True,))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_verify_model_is_exact_for_deepseek_v3(dsv3: dict[str, Path], layout: str,
                                               verified: Callable[[dict[str, Path], str], None]) -> None:
    """Logits ≤ 1e-4 of transformers' (fp32) and every exported tensor bit-identical to the checkpoint's, with the
    query LoRA and without. ~10–20 s per layout: one launch of its 1 or 2 ranks for both checkpoints."""
    verified(dsv3, layout)


@pytest.mark.distributed
@pytest.mark.parametrize(("first", "last", "stages"), [(1, None, [1, 2]), (None, 1, [2, 1])])
def test_verify_model_is_exact_on_uneven_pipeline_stages(dsv3: dict[str, Path], tiny_checkpoints: dict[str, Path],
                                                         first: int | None, last: int | None,
                                                         stages: list[int]) -> None:
    """DeepSeek-V3's 61 layers split over pipeline stages only unevenly (``num_layers_in_first/last_pipeline_stage``,
    hybridrl.megatron.stages): at PP=2 with one layer on the first stage (the dense one alone) or on the last, both
    tiny DeepSeek-V3s and a dense Qwen2 with tied embeddings (4 layers: 1 + 3, 3 + 1) give transformers' logits and
    export bit-identical tensors. ~12 s per split: one launch of 2 ranks for the three checkpoints."""
    from hybridrl.megatron.verify import run_verification

    models = {"q_lora": dsv3["q_lora"], "q_proj": dsv3["q_proj"], "qwen2_tied": tiny_checkpoints["qwen2_tied"]}
    reports = run_verification(list(models.values()), pp=2, first=first, last=last, bucket_bytes=20_000)
    for (name, path), r in zip(models.items(), reports, strict=True):
        print(f"{name} first={first} last={last}: max_abs_logit_diff={r.max_abs_logit_diff:.3g}, {r.stage_layers}")
        assert r.max_abs_logit_diff <= 1e-4, (name, r)
        assert r.roundtrip_exact and r.n_tensors == len(load_file(path / "model.safetensors")), (name, r.mismatches)
    dense = [3, 1] if last else [1, 3]
    assert [r.stage_layers for r in reports] == [stages, stages, dense]


def test_the_hf_engine_generates_what_transformers_generates(dsv3: dict[str, Path], tmp_path: Path,
                                                              discriminate: Callable[[Path, int], Path],
                                                              serves: Callable[[RolloutEngine, Path], float]) -> None:
    """And takes the trainer's weight stream in place (the routers' ``e_score_correction_bias`` buffers included):
    after a swap to another draw of the same shape it serves that draw."""
    from hybridrl.rollout.engines.hf import HFRolloutEngine

    for path in dsv3.values():
        assert serves(HFRolloutEngine(HFRolloutEngine.Config(), model_path=str(path)), path) < 1e-5
    other = _sharpen(discriminate(Path(shutil.copytree(dsv3["q_lora"], tmp_path / "other")), 9))
    engine = HFRolloutEngine(HFRolloutEngine.Config(), model_path=str(dsv3["q_lora"]))
    engine.update_weights(iter([sorted(load_file(other / "model.safetensors").items())]), version=1)
    assert serves(engine, other) < 1e-5


def test_the_local_spec_adaptations_for_mla_are_still_needed() -> None:
    """``hybridrl.megatron.cpu``: the local ``DotProductAttention`` refuses MLA's ``k_channels``/``v_channels``
    (:class:`~hybridrl.megatron.cpu.MLADotProductAttention`); and without Transformer Engine its extension module
    still imports, with mock layers, which is what makes ``multi_latent_attention.HAVE_TE`` True and its
    ``isinstance(..., TELinear)`` raise (:func:`~hybridrl.megatron.cpu.use_mla_without_transformer_engine`)."""
    from megatron.core.extensions import transformer_engine as te
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    assert "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters
    if not te.HAVE_TE:  # CPU: the import MLA's flag rests on succeeds, and gives no class
        from megatron.core.extensions.transformer_engine import TELinear

        assert not isinstance(TELinear, type)
