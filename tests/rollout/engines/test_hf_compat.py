"""``hybridrl/rollout/engines/hf_compat.py``: each adaptation of the ``hf`` engine to transformers, and that it is still
needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hybridrl.interfaces import SamplingParams
from hybridrl.models.tiny import TinyModelSpec, make_tiny_model
from hybridrl.rollout.engines.hf import HFRolloutEngine

MOE = dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("hf_compat") / "a", arch="qwen3_moe", hidden=32, layers=2,
                           heads=4, kv_heads=2, max_positions=64, moe=MOE)


@pytest.fixture(scope="module")
def mixtral_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mixtral's checkpoint names its MoE block ``block_sparse_moe`` (router and experts ``w1``/``w3``/``w2``);
    transformers keeps it as ``mlp`` in memory."""
    return make_tiny_model(tmp_path_factory.mktemp("hf_compat") / "mixtral", arch="mixtral", hidden=32, layers=2,
                           heads=4, kv_heads=2, intermediate=16, max_positions=64, moe=dict(num_local_experts=3))


def test_item1_transformers_fuses_the_experts_the_checkpoint_holds_one_by_one(moe_model: Path) -> None:
    """The loaded model has no parameter under a checkpoint expert's name, only the fused ones."""
    names = {n for n, _ in AutoModelForCausalLM.from_pretrained(moe_model).named_parameters()}
    on_disk = set(load_file(moe_model / "model.safetensors"))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in on_disk - names
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= names


@pytest.mark.parametrize("fixture", ["moe_model", "mixtral_model"])
def test_a_streamed_moe_checkpoint_lands_in_the_fused_experts_in_place(fixture: str, tmp_path: Path,
                                                                       request: pytest.FixtureRequest) -> None:
    """Perturbed per-expert (and other) tensors streamed by their checkpoint names: the engine then samples what
    a fresh load of the perturbed checkpoint samples, and the fused storage was not reallocated."""
    moe_model: Path = request.getfixturevalue(fixture)
    engine = HFRolloutEngine(HFRolloutEngine.Config(), model_path=str(moe_model))
    fused = engine.params["model.layers.0.mlp.experts.gate_up_proj"].data_ptr()
    state = load_file(moe_model / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    engine.update_weights([list(new.items())], version=1)
    assert engine.params["model.layers.0.mlp.experts.gate_up_proj"].data_ptr() == fused
    other = tmp_path / "b"
    other.mkdir()
    for f in moe_model.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    save_file(new, other / "model.safetensors", metadata={"format": "pt"})
    fresh = HFRolloutEngine(HFRolloutEngine.Config(), model_path=str(other))
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    a, b = engine.generate([[5, 6, 7]], params), fresh.generate([[5, 6, 7]], params)
    assert a[0].token_ids == b[0].token_ids
    torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs), atol=1e-5, rtol=0)


def test_item2_only_the_router_tells_which_experts_a_token_went_to(moe_model: Path) -> None:
    """The MoE block returns one tensor (the mixed hidden states); its router's third output is the top-k of
    softmax(x Wᵀ), which the recorder reads, one [tokens, k] per MoE layer and forward."""
    from hybridrl.rollout.engines.hf_compat import RoutingRecorder

    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, 32)
    assert isinstance(block(x), torch.Tensor)
    logits, weights, chosen = block.gate(x.reshape(-1, 32))
    assert torch.equal(chosen, torch.topk(torch.softmax(x.reshape(-1, 32) @ block.gate.weight.T, -1), 2).indices)
    recorder = RoutingRecorder(model)
    assert len(recorder.gates) == 1  # layer 1 is dense (mlp_only_layers)
    route = recorder.start(1, 5)
    with torch.no_grad():
        model(input_ids=torch.tensor([[3, 4, 5, 6, 7]]))
    recorder.collect(route, torch.tensor([0]), torch.arange(5))
    recorder.stop()
    assert route.shape == (1, 5, 1, 2) and int(route.min()) >= 0 and not recorder._hooks


def test_item3_transformers_renames_a_vlms_parameters(tmp_path: Path) -> None:
    """transformers loads Qwen2.5-VL's ``model.*`` and ``visual.*`` tensors as ``model.language_model.*`` and
    ``model.visual.*``; :func:`vlm_checkpoint_names` names every parameter as the checkpoint does — the names
    transformers' own save-time renaming gives (the same tensors, so a copy into one lands in the parameter)."""
    from transformers import AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    from hybridrl.models.tiny_vlm import TinyVisionSpec, make_tiny_vlm
    from hybridrl.rollout.engines.hf_compat import vlm_checkpoint_names
    from hybridrl.vlm.sglang_compat import transformers_rope_rules

    path = make_tiny_vlm(tmp_path / "vlm", text=TinyModelSpec(hidden=32, layers=1, heads=2, kv_heads=1, tie=False),
                         vision=TinyVisionSpec(depth=1, hidden=16, heads=1))
    with transformers_rope_rules():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    params = dict(model.named_parameters())
    on_disk = set(load_file(path / "model.safetensors"))
    assert {"model.embed_tokens.weight", "visual.patch_embed.proj.weight"} <= on_disk - set(params)
    names = vlm_checkpoint_names(params, "qwen2_5_vl")
    assert set(names) | {"lm_head.weight"} == on_disk
    saved = revert_weight_conversion(model, params)
    assert all(saved[n] is t for n, t in names.items())
    assert vlm_checkpoint_names(params, "qwen2") == {}


def test_item3_qwen3_vl_needs_no_renaming(tmp_path: Path) -> None:
    """Qwen3-VL's checkpoint names are transformers' own parameter names (``model.language_model.*``,
    ``model.visual.*``, ``lm_head.weight``): :func:`vlm_checkpoint_names` adds none, and every checkpoint tensor is a
    parameter by its name (item 3 is Qwen2.5-VL's alone)."""
    from transformers import AutoModelForImageTextToText

    from hybridrl.models.tiny_vlm import TinyVisionSpec, make_tiny_vlm
    from hybridrl.rollout.engines.hf_compat import vlm_checkpoint_names
    from hybridrl.vlm.sglang_compat import transformers_rope_rules

    path = make_tiny_vlm(tmp_path / "vlm", text=TinyModelSpec(hidden=32, layers=1, heads=2, kv_heads=1, tie=False),
                         vision=TinyVisionSpec(depth=1, hidden=16, heads=1), family="qwen3_vl")
    with transformers_rope_rules():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    params = dict(model.named_parameters())
    assert set(load_file(path / "model.safetensors")) == set(params)
    assert vlm_checkpoint_names(params, "qwen3_vl") == {}
