"""A vision-language model on Megatron (Qwen2.5-VL, Qwen3-VL): its config read as a causal LM with multimodal RoPE,
the multimodal positions equal transformers', and ``hybridrl verify-model`` — an image in every row — gives
transformers' logits and an exact round trip (vision tower included) at TP=2 and at PP=2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.tiny_vlm import END, IMAGE, START, VIDEO, make_tiny_qwen2_5_vl, make_tiny_qwen3_vl

from hybridrl.hf.arch import HFArch
from hybridrl.megatron.verify import run_verification
from hybridrl.vlm.positions import mrope_positions


@pytest.fixture(scope="module")
def vlms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("vlm")
    out = {name: make_tiny_qwen2_5_vl(tmp / name, tie=name == "tied") for name in ("tied", "untied")}
    return {**out, "qwen3": make_tiny_qwen3_vl(tmp / "qwen3", tie=True)}


def test_both_config_layouts_read_as_one_language_model(vlms: dict[str, Path], tmp_path: Path) -> None:
    nested = json.loads((vlms["untied"] / "config.json").read_text())
    arch = HFArch.from_hf(nested, source="nested")
    assert (arch.family, arch.mrope_section, arch.num_layers, arch.head_dim, arch.qkv_bias) == ("qwen2", (2, 3, 3), 4,
                                                                                              16, True)
    assert arch.vision is not None and arch.vision.image_token_id == IMAGE and arch.vision.spatial_merge_size == 2
    # transformers 4's layout (the published checkpoints): the language model's fields at the top level
    text = nested.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **nested, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    assert HFArch.from_hf(flat, source="flat") == arch
    flat["rope_scaling"]["mrope_section"] = [2, 3, 4]
    with pytest.raises(ValueError, match=r"flat: rope_scaling.mrope_section=\[2, 3, 4\] must sum to head_dim / 2 = 8"):
        HFArch.from_hf(flat, source="flat")


def test_positions_equal_transformers(vlms: dict[str, Path]) -> None:
    """Two images of different grids in one row, text around and between them; a row of text alone."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlms["tied"]).eval()
    arch = HFArch.from_hf(vlms["tied"])
    assert arch.vision is not None
    grids = torch.tensor([[1, 4, 6], [1, 8, 2]])  # 6 and 4 placeholders at merge 2
    row = torch.tensor([5, 6, START, *[IMAGE] * 6, END, 7, 8, 9, START, *[IMAGE] * 4, END, 10])
    ref, _ = model.model.get_rope_index(row[None], (row == IMAGE).int()[None], grids, None, None,
                                        torch.ones_like(row)[None])
    assert torch.equal(mrope_positions(row, grids, arch.vision), ref[:, 0])
    text = torch.arange(10)
    assert torch.equal(mrope_positions(text, None, arch.vision), torch.arange(10).expand(3, -1))
    with pytest.raises(ValueError, match=r"needs 6 placeholder tokens in a row"):
        mrope_positions(row[:5], grids, arch.vision)
    with pytest.raises(NotImplementedError, match="a video"):
        mrope_positions(torch.tensor([5, VIDEO]), None, arch.vision)


@pytest.mark.distributed
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_verify_model_with_an_image_is_exact(vlms: dict[str, Path], tp: int, pp: int) -> None:
    """Logits ≤ 1e-4 of transformers' (measured ~5e-7) and a bit-exact round trip of every tensor, the vision
    tower's too; Qwen3-VL's interleaved M-RoPE and DeepStack (after layers 0 and 1, both on the first stage at PP=2)
    included. ~20 s a layout on idle cores (two ranks each import Megatron and transformers)."""
    reports = run_verification([vlms["tied"], vlms["untied"], vlms["qwen3"]], tp=tp, pp=pp, seq_len=24, batch=2)
    for r in reports:
        assert r.max_abs_logit_diff <= 1e-4 and r.roundtrip_exact, r  # a tensor left out is a mismatch too


def test_an_engine_tells_a_vlm_checkpoint_from_a_causal_lm(vlms: dict[str, Path], tmp_path: Path) -> None:
    from hybridrl.hf.vlm import checkpoint_vision

    spec = checkpoint_vision(vlms["tied"])
    assert spec is not None and spec.image_token_id == IMAGE
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert checkpoint_vision(text) is None
    (text / "config.json").write_text(json.dumps({"model_type": "llava_next", "vision_config": {}}))
    with pytest.raises(ValueError, match="model_type='llava_next' is not a vision-language family hybridrl knows; "
                                         "valid: qwen2_5_vl, qwen3_vl"):
        checkpoint_vision(text)


def test_qwen3_vl_reads_as_qwen3_with_interleaved_mrope_and_deepstack(vlms: dict[str, Path]) -> None:
    """Its language model is Qwen3 (q/k norms, no q/k/v bias) under ``model.language_model.``; the M-RoPE channel
    layout and the DeepStack layers come from its config; the interleaved layout is transformers'."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from hybridrl.hf.vlm import vision_parameters
    from hybridrl.vlm.mrope import channel_axes

    arch = HFArch.from_hf(vlms["qwen3"])
    assert (arch.family, arch.qk_layernorm, arch.qkv_bias, arch.head_dim, arch.hf_prefix) == (
        "qwen3", True, False, 32, "model.language_model.")
    v = arch.vision
    assert v is not None and (v.family, v.mrope_interleaved, v.deepstack_layers, v.vision_prefix) == (
        "qwen3_vl", True, 2, "model.visual.")

    class Config:
        mrope_section = [6, 5, 5]

    axis_ids = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, 16).clone()  # channel value = its axis
    mixed = Qwen3VLTextRotaryEmbedding.recomposition_frequencies(Config(), axis_ids)[0, 0, :16]
    assert torch.equal(channel_axes([6, 5, 5]), mixed.long())
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(vlms["qwen3"])
    assert vision_parameters(v.config, v.family) == sum(p.numel() for p in model.model.visual.parameters())
