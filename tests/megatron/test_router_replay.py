"""Router replay (``actor_rollout_ref.actor.router_replay.mode``: R2, R3) and the MoE router losses on a tiny
Qwen3-MoE (6 experts, top-3, a dense layer among the MoE ones), through ``MegatronPolicy`` and the ``hf`` engine on
one rank (``workers/router_replay_checks.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.models.tiny import make_tiny_model

WORKER = Path(__file__).parent / "workers" / "router_replay_checks.py"


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """~35 s: six policies and two engines built in one process."""
    model = make_tiny_model(tmp_path_factory.mktemp("replay") / "moe", arch="qwen3_moe", hidden=32, layers=3, heads=4,
                            kv_heads=2, max_positions=64,
                            moe=dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16,
                                     mlp_only_layers=[1]))
    proc = subprocess.run([sys.executable, str(WORKER), str(model)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_hf_engine_records_the_experts_transformers_routes_each_position_to(checks: dict) -> None:
    """Prompt positions (the prefill) and every sampled token but the last (the decoding steps) equal one forward
    over the whole sequence."""
    assert checks["engine_equals_full_forward"] == 1.0


def test_r3_routes_the_trainer_as_the_engine_did(checks: dict) -> None:
    """fp32: the trainer's routing equals the engine's and the log-probs agree; bf16 (engine and trainer each in
    bf16, different kernels): some (token, layer) pairs route otherwise on their own, the replay makes every one
    route as the engine did, and the log-prob mismatch does not grow."""
    diff, metrics = checks["r3_fp32"]
    assert diff < 1e-6 and metrics["router_replay/engine_mismatch"] == 0.0
    assert checks["r3_fp32_used_equals_engine"] == 1.0
    assert checks["bf16_r3"][1]["router_replay/engine_mismatch"] > 0
    assert checks["bf16_r3_used_equals_engine"] == 1.0
    assert checks["bf16_r3"][0] <= checks["bf16_disabled"][0]
    assert checks["bf16_disabled"][1] == {}  # disabled: nothing replayed, nothing measured


def test_r2_replays_the_old_log_prob_pass_routing_in_the_update(checks: dict) -> None:
    """The first update routes as the old pass did (nothing changed yet); after it the weights would route most
    pairs otherwise (lr 3e-2), and the replay still routes every one as recorded."""
    assert checks["r2_recorded"]
    first, *later = checks["r2_update_mismatch"]
    assert first == 0.0 and all(m > 0.1 for m in later)
    assert checks["r2_used_equals_recorded"] == 1.0


def test_the_router_losses_are_off_by_default_and_logged_when_on(checks: dict) -> None:
    """``override_transformer_config.moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` (verl's keys): Megatron's
    load-balancing loss (≈ 1 for balanced routing) and z-loss reach the gradient and the metrics."""
    on, off = checks["aux_on"], checks["aux_off"]
    assert 0.5 < on["moe_load_balancing_loss"] < 3 and on["moe_z_loss"] > 0
    assert "moe_load_balancing_loss" not in off and "moe_z_loss" not in off
    assert on["grad_norm"] != off["grad_norm"]


def test_experts_have_their_own_optimizer_at_ep1_which_megatron_still_does_only_at_ep_above_1(checks: dict) -> None:
    """``hybridrl/megatron/moe_compat.py`` item 2: at EP = 1 Megatron leaves every expert weight ``allreduce=True``
    (one optimizer; fails once upstream marks them at every EP and the item can go); hybridrl's build marks every
    routed expert's weight, so the actor's optimizer is the same chain of two (dense, experts) as at EP > 1."""
    marking = checks["expert_marking"]
    assert marking["upstream"] == 0
    assert marking["ours"] == marking["experts"] == 2 * 6 * 2  # 2 MoE layers × 6 experts × (fc1, fc2)
    assert marking["optimizers"] == 2
