"""Aux-loss-free balancing as DeepSeek-V3 trains it (Wang et al. 2024, arXiv:2408.15664): a sigmoid router's expert
bias b (the checkpoint's ``e_score_correction_bias``) only selects experts, and after each optimizer step moves by
b_e += u · sign(mean load − load_e), u = ``override_transformer_config.moe_router_bias_update_rate`` (Megatron's
update, in its ``finalize_model_grads``). On by config: 0 (the default here, as in slime's GLM-4.5 script) keeps the
checkpoint's bias. Checked on a tiny GLM-4.5 (the bias DeepSeek-V3 shares), one rank: each entry moves by exactly
±u or 0 per step, each step counts only its own loads (Megatron-LM's train step resets them; so does hybridrl's),
and the weight stream carries the moved bias to the engine. ~25 s: one torchrun launch."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hybridrl.models.tiny import make_tiny_model

WORKER = str(Path(__file__).parent / "workers" / "expert_bias_step.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, discriminate: Callable[[Path, int], Path]) -> Path:
    out = discriminate(make_tiny_model(tmp_path_factory.mktemp("expert_bias") / "glm", arch="glm4_moe", hidden=64,
                                       layers=2, heads=4, kv_heads=2, max_positions=128, tie=False, seed=3,
                                       moe=dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                n_shared_experts=1, first_k_dense_replace=0, n_group=1,
                                                topk_group=1)), 5)
    state = load_file(out / "model.safetensors")
    for key in [k for k in state if k.endswith("mlp.gate.weight")]:
        state[key] = state[key] * 20  # loads spread over the experts, unevenly
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _run(torchrun, model: Path, out: Path, rate: float) -> list[dict]:
    torchrun([WORKER, str(model), str(out), str(rate)], nproc=1)
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_the_expert_bias_moves_by_the_sign_of_each_steps_own_loads(torchrun, model: Path, tmp_path: Path) -> None:
    rate = 0.01
    steps = _run(torchrun, model, tmp_path / "on.json", rate)
    moved = 0
    for s in steps:
        for before, after in zip(s["before"], s["after"], strict=True):
            deltas = [round((a - b) / rate, 3) for a, b in zip(after, before, strict=True)]
            assert set(deltas) <= {-1.0, 0.0, 1.0}, deltas
            assert 1.0 in deltas and -1.0 in deltas  # uneven loads: the busiest go down, the idlest up
            moved += sum(d != 0 for d in deltas)
        assert all(c == 0 for counts in s["counts_left"] for c in counts)  # the next step counts afresh
        assert sorted(s["exported"].values()) == sorted(s["after"])  # the engine receives the moved bias
    assert moved > 0  # (rate 0 keeps the checkpoint's bias: test_glm4_moe's actor check)
