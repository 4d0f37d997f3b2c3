"""The RL loop with an MoE actor (a tiny Qwen3-MoE, ``hybridrl/megatron`` MoE layers, the ``hf`` engine's fused
experts swapped in place): expert parallelism changes nothing but where the experts live."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from support.e2e import TRAIN, chatty, overrides, read_metrics, tiny  # noqa: F401

from hybridrl.models.tiny import make_tiny_model

KEYWORD = ("reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any")


def _learned(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("timing", "perf/"))}
            for r in read_metrics(out) if r["step"] > 0]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in b:
        assert math.isclose(a[k], b[k], rel_tol=0, abs_tol=1e-6), (a["step"], k, a[k], b[k])


@pytest.mark.distributed
def test_an_expert_parallel_run_equals_the_replicated_one_and_resumes_across_ep(
        torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    """2 ranks, EP=2 (each holds 2 of the 4 experts; the distributed optimizer) against EP=1 (DP=2, every rank all
    experts; the plain optimizer): the same metrics to 1e-6 over 3 learning steps, and the engine's log-probs agree
    with the actor's at every step (the experts reach the engine). Then each run's step-2 checkpoint resumes at the
    *other* EP with its own optimizer (experts and their Adam state reshard: moe_compat item 2 keeps one optimizer
    layout at every EP): step 3 equals the uninterrupted runs' to 1e-6 (that one rank trains what EP=2 trains: the
    next test). ~80 s: four 2-rank launches."""
    moe = {**tiny, "model": make_tiny_model(tiny["tmp"] / "moe_model", arch="qwen3_moe", hidden=64, layers=2,
                                            heads=4, kv_heads=2, max_positions=128,
                                            moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))}
    common = (*KEYWORD, "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=2",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    ep_key = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"
    optimizer = {ep: f"actor_rollout_ref.actor.megatron.use_distributed_optimizer={ep == 2}" for ep in (1, 2)}
    runs = {}
    for ep in (1, 2):
        out = tiny["tmp"] / f"moe_ep{ep}"
        torchrun([TRAIN, *overrides(moe, out, *common, f"{ep_key}={ep}", optimizer[ep])], nproc=2, timeout=600)
        runs[ep] = _learned(out)
    assert [r["step"] for r in runs[2]] == [1, 2, 3]
    assert runs[1][0]["actor/grad_norm"] > 0.1  # a real update
    for a, b in zip(runs[2], runs[1], strict=True):
        assert a["rollout/logprob_abs_diff"] <= 1e-5
        _same(a, b)
    for saved, now in ((2, 1), (1, 2)):
        resumed = tiny["tmp"] / f"moe_ep{saved}_at_ep{now}"
        shutil.copytree(tiny["tmp"] / f"moe_ep{saved}", resumed)
        shutil.rmtree(resumed / "checkpoints" / "step_00000003")
        torchrun([TRAIN, *overrides(moe, resumed, *common, f"{ep_key}={now}", optimizer[saved])], nproc=2,
                 timeout=600)
        again = _learned(resumed)
        assert [r["step"] for r in again] == [1, 2, 3]
        _same(again[2], runs[saved][2])


@pytest.mark.distributed
def test_token_budget_micro_batches_at_ep2_train_what_one_rank_trains(torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    """EP=2 with ``use_dynamic_bsz`` (verl's MoE scripts all use it): responses end early and unevenly (``chatty``),
    so the two ranks' token budgets make different micro-batch counts and shapes; the runner splits to one count
    and pads micro-batch k to one shape over the EP ranks (fillers masked out), and the run equals one rank's
    with the same budget to 1e-5 (the log-prob passes and the update). ~45 s: a 2-rank and a 1-rank launch."""
    random = make_tiny_model(tiny["tmp"] / "moe_dyn_random", arch="qwen3_moe", hidden=64, layers=2, heads=4,
                             kv_heads=2, max_positions=128,
                             moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    moe = {**tiny, "model": chatty(random, tiny["tmp"] / "moe_dyn_model")}
    args = [*KEYWORD, "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.total_training_steps=2",
            "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40"]
    runs = []
    for ep, nproc in ((2, 2), (1, 1)):
        out = tiny["tmp"] / f"moe_dyn_ep{ep}"
        ep_arg = f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}"
        torchrun([TRAIN, *overrides(moe, out, *args, ep_arg)], nproc=nproc, timeout=600)
        runs.append(_learned(out))
    assert [r["step"] for r in runs[0]] == [1, 2] and runs[1][0]["actor/grad_norm"] > 0.01
    for a, b in zip(*runs, strict=True):
        assert b.keys() <= a.keys()
        for k in b:
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-5), (a["step"], k, a[k], b[k])


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_a_router_replay_run_resumes_bitwise(torchrun, tiny: dict[str, Path], mode: str) -> None:  # noqa: F811
    """2 ranks at EP=2, ``actor.router_replay.mode`` R3 or R2, 2 mini-batches a step (the old-log-prob pass runs):
    every update reports its replay, R3's trainer routes as the engine did (fp32: no pair differs), and a run resumed
    from its step-2 checkpoint gives step 3 exactly (the routing is per step, never saved: R3's comes with the
    samples, R2's old pass records it again; R2's replay itself is checked in ``megatron/test_router_replay.py``).
    The responses vary in length from rank to rank. R3 ~50 s: two 2-rank launches; R2 ~25 s: the resume is R3's path
    (nothing routed is saved in either), so the CI budget runs it for R3 only."""
    random = make_tiny_model(tiny["tmp"] / f"moe_replay_random_{mode}", arch="qwen3_moe", hidden=64, layers=2,
                             heads=4, kv_heads=2, max_positions=128,
                             moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    # responses end at EOS early and unevenly: each rank's rows have another length, which the EP ranks' token
    # exchange must not see (the runner pads to the longest over the EP group)
    moe = {**tiny, "model": chatty(random, tiny["tmp"] / f"moe_replay_model_{mode}")}
    out = tiny["tmp"] / f"replay_{mode}"
    args = [*KEYWORD, "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            f"actor_rollout_ref.actor.router_replay.mode={mode}"]
    torchrun([TRAIN, *overrides(moe, out, *args)], nproc=2, timeout=600)
    reference = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in reference] == [1, 2, 3]
    for r in reference:
        assert 0.0 <= r["actor/router_replay_mismatch"] <= 1.0
        assert r["rollout/logprob_abs_diff"] <= 1e-5
        if mode == "R3":
            assert r["router_replay/engine_mismatch"] == 0.0
    if mode == "R2":
        return
    resumed = tiny["tmp"] / f"replay_{mode}_resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000003")
    torchrun([TRAIN, *overrides(moe, resumed, *args)], nproc=2, timeout=600)
    again = [r for r in read_metrics(resumed) if r["step"] > 0]
    assert [r["step"] for r in again] == [1, 2, 3]
    strip = [{k: v for k, v in r.items() if not k.startswith(("timing", "perf/"))} for r in (reference[2], again[2])]
    assert strip[0] == strip[1]


def test_an_ep1_moe_checkpoint_with_one_optimizer_is_refused_naming_the_way_out(tmp_path: Path) -> None:
    """Before moe_compat item 2, an EP=1 MoE run saved one optimizer (not the chain every EP now builds): resuming
    it is refused before dist_checkpointing's KeyError, saying how to carry its weights on; a chained one passes."""
    from types import SimpleNamespace

    import torch

    from hybridrl.checkpoint.rl import _check_expert_layout

    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", '
        '"common_backend_version": 1}')
    policy = SimpleNamespace(arch=SimpleNamespace(moe=object()), optimizer=SimpleNamespace(chained_optimizers=[1, 2]))
    torch.save({"optimizer": {"param_groups": [], "state": {}}}, tmp_path / "megatron" / "common.pt")
    with pytest.raises(ValueError, match=r"as one optimizer .*\(hybridrl export-hf .* trainer.resume=never\)"):
        _check_expert_layout(tmp_path, policy)  # type: ignore[arg-type]
    torch.save({"optimizer": {0: {"param_groups": []}, 1: {"param_groups": []}}}, tmp_path / "megatron" / "common.pt")
    _check_expert_layout(tmp_path, policy)  # type: ignore[arg-type]
    _check_expert_layout(tmp_path / "nowhere", SimpleNamespace(arch=SimpleNamespace(moe=None), optimizer=None))  # type: ignore[arg-type]
    policy.optimizer = SimpleNamespace()  # one optimizer (LoRA: the experts frozen): nothing to compare
    _check_expert_layout(tmp_path / "nowhere", policy)  # type: ignore[arg-type]


@pytest.mark.distributed
def test_lora_on_the_experts_syncs_and_exports_an_adapter_with_expert_weights(torchrun,
                                                                              tiny: dict[str, Path]) -> None:  # noqa: F811
    """LoRA on the MLP projections of an MoE actor at EP=2 (``target_modules: [gate_proj, up_proj, down_proj]``):
    the experts' adapters train, the engine receives every expert's merged weights (its log-probs agree with the
    actor's at each step), and ``export-hf --adapter`` writes a peft adapter with each expert's A and B, read back
    from the EP=2 checkpoint on one process. ~60 s: a 2-rank launch and an export."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    moe = {**tiny, "model": make_tiny_model(tiny["tmp"] / "moe_lora_model", arch="qwen3_moe", hidden=64, layers=2,
                                            heads=4, kv_heads=2, max_positions=128,
                                            moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))}
    out = tiny["tmp"] / "moe_lora"
    args = [*KEYWORD, "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.total_training_steps=2",
            "trainer.save_freq=2", "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.model.target_modules=[gate_proj,up_proj,down_proj]",
            "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"]
    torchrun([TRAIN, *overrides(moe, out, *args)], nproc=2, timeout=600)
    rows = _learned(out)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["actor/grad_norm"] > 0
    assert all(r["rollout/logprob_abs_diff"] <= 1e-5 for r in rows), rows
    adapter = tiny["tmp"] / "moe_lora_adapter"
    done = subprocess.run([sys.executable, "-m", "hybridrl.cli", "export-hf",
                           str(out / "checkpoints" / "step_00000002"), str(adapter), "--adapter"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = load_file(adapter / "adapter_model.safetensors")
    for layer in (0, 1):
        for e in range(4):
            for p in ("gate_proj", "up_proj", "down_proj"):
                b = saved[f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{p}.lora_B.weight"]
                assert b.shape[1] == 4
    assert any(float(t.abs().max()) > 0 for k, t in saved.items() if k.endswith("lora_B.weight"))
