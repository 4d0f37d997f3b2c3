"""GLM-4.5 (HF ``Glm4MoeForCausalLM``) in Megatron's MoE layers: config.json read as a dense first layer
(``first_k_dense_replace``) then sigmoid-routed MoE layers (``e_score_correction_bias``, ``n_group``/``topk_group``
grouped top-k, ``routed_scaling_factor``, an ungated shared expert), q/k/v bias, QK norm on or off and RoPE over half
of each head; what Megatron's router computes otherwise is refused naming the key; ``hybridrl verify-model`` — logits
against transformers and a bitwise round trip — at TP=1, TP=2 and EP=2, both checkpoints in one launch each; the hf
rollout engine serves it as transformers does; and an actor on it (``workers/glm4_moe_step.py``, one rank): the
routers' expert biases float32 and exact in a bf16 model, log-probs equal to the engine's, R3 replaying its routing,
training steps that leave the biases as loaded.

The checkpoints: 8 experts in 2 groups (1 chosen), top-2, hidden 48, 3 layers, 6 heads over 2 KV groups (head_dim 8,
4 of it rotated), experts and shared expert 16 wide, dense layer 40 wide, untied embeddings; one made by the CLI
(``hybridrl make-tiny-model --arch glm4_moe --moe use_qk_norm=true``), one by :func:`make_tiny_model` without QK
norm. Both are made discriminating (tests/conftest.py: norms, q/k/v and expert biases redrawn, q/k sharpened, which a
misplaced bias or norm or a wrong rotary fraction would show) and their routers scaled ×10 (sigmoid scores spread over
(0, 1), no near-ties), so that the bias and the groups change which experts a token gets (checked below)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
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

WORKER = Path(__file__).parent / "workers" / "glm4_moe_step.py"
SHAPE = dict(hidden=48, layers=3, heads=6, kv_heads=2, intermediate=40, max_positions=64, seed=11)


def _decisive_routing(path: Path) -> Path:
    """Router logits ~ N(0, 1.4²): sigmoid scores spread over (0, 1), choices far from ties."""
    state = load_file(path / "model.safetensors")
    for key in [k for k in state if k.endswith("mlp.gate.weight")]:
        state[key] = state[key] * 10
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory, discriminate: Callable[[Path, int], Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm4_moe")
    qk = root / "qk_norm"
    assert cli(["make-tiny-model", str(qk), "--arch", "glm4_moe", "--no-tie", "--moe", "use_qk_norm=true",
                "--moe", "moe_intermediate_size=16", *(f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items())]) == 0
    plain = make_tiny_model(root / "plain", arch="glm4_moe", tie=False, moe=dict(moe_intermediate_size=16), **SHAPE)
    for seed, path in enumerate((qk, plain)):
        _decisive_routing(discriminate(path, seed))
    return {"qk_norm": qk, "plain": plain}


def test_the_architecture_is_read_from_config_json(glm: dict[str, Path]) -> None:
    arch = HFArch.from_hf(glm["qk_norm"])
    assert (arch.family, arch.qkv_bias, arch.qk_layernorm, arch.rotary_percent) == ("glm4_moe", True, True, 0.5)
    assert HFArch.from_hf(glm["plain"]).qk_layernorm is False
    moe = arch.moe
    assert moe is not None and moe.sparse_layers == (False, True, True)
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.shared_ffn_hidden_size, moe.shared_expert_gate) == (
        8, 2, 16, 16, False)
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk, moe.scaling_factor) == (
        "sigmoid", True, 2, 1, 2.5)
    # every checkpoint tensor is some unit's, by the checkpoint's own names
    on_disk = set(load_file(glm["qk_norm"] / "model.safetensors"))
    assert on_disk == {n for u in all_units(arch) for n in u.hf_names}
    assert {"model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
            "model.layers.2.mlp.shared_experts.down_proj.weight",
            "model.layers.2.mlp.experts.7.up_proj.weight"} <= on_disk


def test_the_bias_and_the_groups_change_the_routing(glm: dict[str, Path]) -> None:
    """Else the logit check below would pass with either ignored: on the test's tokens, transformers' router picks
    other experts for some tokens without the bias, and without the group limit."""
    model = AutoModelForCausalLM.from_pretrained(glm["plain"], dtype=torch.float32).eval()
    gate = model.model.layers[1].mlp.gate
    seen: list[torch.Tensor] = []
    gate.register_forward_hook(lambda _m, args, _out: seen.append(args[0].reshape(-1, 48)))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0)))
        chosen = gate(seen[0])[2].sort().values
        bias = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        unbiased = gate(seen[0])[2].sort().values
        gate.e_score_correction_bias.copy_(bias)
        gate.num_group = gate.topk_group = 1
        ungrouped = gate(seen[0])[2].sort().values
    assert (chosen != unbiased).any(dim=1).sum() >= 3
    assert (chosen != ungrouped).any(dim=1).sum() >= 3


def test_what_megatron_does_not_model_is_refused_naming_the_key(glm: dict[str, Path]) -> None:
    cfg = json.loads((glm["plain"] / "config.json").read_text())
    with pytest.raises(NotImplementedError, match="norm_topk_prob=False with num_experts_per_tok=2 is not supported; "
                                                  "valid: True"):
        HFArch.from_hf({**cfg, "norm_topk_prob": False})
    with pytest.raises(NotImplementedError, match="norm_topk_prob=True with num_experts_per_tok=1 is not supported"):
        HFArch.from_hf({**cfg, "num_experts_per_tok": 1})
    with pytest.raises(NotImplementedError, match=r"topk_group=2 with num_experts_per_tok=2 and n_group=4 is not "
                                                  r"supported: .* num_experts_per_tok // topk_group = 1"):
        HFArch.from_hf({**cfg, "n_group": 4, "topk_group": 2})
    with pytest.raises(ValueError, match="n_group=3 must divide n_routed_experts=8"):
        HFArch.from_hf({**cfg, "n_group": 3})
    with pytest.raises(ValueError, match="first_k_dense_replace=4 must be an integer in"):
        HFArch.from_hf({**cfg, "first_k_dense_replace": 4})
    with pytest.raises(ValueError, match=r"\['num_experts'\] are not GLM-4.5 config keys"):
        make_tiny_model(glm["plain"].parent / "bad", arch="glm4_moe", moe=dict(num_experts=4))
    # all groups chosen is no group limit: accepted whatever the top-k
    assert HFArch.from_hf({**cfg, "n_group": 4, "topk_group": 4}).moe.num_groups is None  # type: ignore[union-attr]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp1", "tp2", "ep2"])
def test_verify_model_is_exact_for_glm4_moe(glm: dict[str, Path], layout: str,
                                            verified: Callable[[dict[str, Path], str], None]) -> None:
    """Logits ≤ 1e-4 of transformers' (fp32) and every exported tensor bit-identical to the checkpoint's, QK norm
    on and off. ~15–25 s per layout: one launch of its 1 or 2 ranks for both checkpoints."""
    verified(glm, layout)


def test_the_hf_engine_generates_what_transformers_generates(glm: dict[str, Path], tmp_path: Path,
                                                              discriminate: Callable[[Path, int], Path],
                                                              serves: Callable[[RolloutEngine, Path], float]) -> None:
    """And takes the trainer's weight stream in place, the router's ``e_score_correction_bias`` (a buffer, not a
    parameter) included: after a swap to another draw of the same shape it serves that draw."""
    import shutil

    from hybridrl.rollout.engines.hf import HFRolloutEngine

    for path in glm.values():
        assert serves(HFRolloutEngine(HFRolloutEngine.Config(), model_path=str(path)), path) < 1e-5
    other = _decisive_routing(discriminate(Path(shutil.copytree(glm["plain"], tmp_path / "other")), 9))
    engine = HFRolloutEngine(HFRolloutEngine.Config(), model_path=str(glm["plain"]))
    engine.update_weights(iter([sorted(load_file(other / "model.safetensors").items())]), version=1)
    assert serves(engine, other) < 1e-5


@pytest.mark.vllm
def test_the_vllm_engine_serves_it_and_takes_its_weight_stream(tmp_path: Path,
                                                               discriminate: Callable[[Path, int], Path],
                                                               serves: Callable[[RolloutEngine, Path], float]) -> None:
    """vLLM 0.32 on CPU (head_dim 32: its CPU attention needs ≥ 32): transformers' greedy tokens and log-probs from
    checkpoint A, then from B once B's tensors, by the names the trainer streams (e_score_correction_bias included),
    are swapped in. ~40 s: an engine start."""
    from hybridrl.registry import Registry

    kw: dict = dict(arch="glm4_moe", hidden=64, layers=2, heads=2, kv_heads=1, max_positions=128, tie=False,
                    moe=dict(moe_intermediate_size=32, use_qk_norm=True))
    a, b = (make_tiny_model(tmp_path / name, seed=seed, **kw) for name, seed in (("a", 1), ("b", 2)))
    for seed, path in enumerate((a, b)):
        _decisive_routing(discriminate(path, seed))
    engine = Registry("rollout_engines").build("vllm", {}, key="actor_rollout_ref.rollout", model_path=str(a),
                                               device=torch.device("cpu"))
    try:
        assert serves(engine, a) < 1e-4
        engine.update_weights(iter([sorted(load_file(b / "model.safetensors").items())]), version=1)
        assert serves(engine, b) < 1e-4
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def actor(glm: dict[str, Path]) -> dict:
    """~15 s: three policies and an engine built in one process."""
    proc = subprocess.run([sys.executable, str(WORKER), str(glm["plain"])], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_bf16_actor_keeps_the_routers_expert_bias_in_float32_as_loaded(actor: dict) -> None:
    """Megatron's Float16Module casts every buffer to bf16; the loader puts the bias back in float32 before copying
    (rounded to bf16, GLM-4.5's biases would choose other experts)."""
    assert actor["bf16_biases"] == [["torch.float32", True], ["torch.float32", True]]


@pytest.mark.slow
def test_the_actor_reads_what_the_engine_sampled_and_r3_replays_its_routing(actor: dict) -> None:
    assert actor["fp32_logprob_diff"] < 1e-5
    assert actor["r3_used_equals_engine"] == 1.0


@pytest.mark.slow
def test_training_steps_leave_the_expert_bias_as_loaded(actor: dict) -> None:
    """``moe_router_bias_update_rate`` is 0 unless ``override_transformer_config`` sets it: the weights learn, the
    bias (Megatron's aux-loss-free balancing) does not move."""
    assert all(math.isfinite(n) and n > 0 for n in actor["grad_norms"])
    assert actor["weights_moved"] > 1e-3 and actor["biases_kept"]
