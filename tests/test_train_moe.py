"""The RL loop with an MoE actor (a tiny Qwen3-MoE, ``hybridrl/megatron`` MoE layers, the ``hf`` engine's fused
experts swapped in place): expert parallelism changes nothing but where the experts live."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from test_train_e2e import TRAIN, chatty, overrides, read_metrics, tiny  # noqa: F401

from hybridrl.models.tiny import make_tiny_model

KEYWORD = ("reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any")


@pytest.mark.distributed
def test_an_expert_parallel_run_equals_the_replicated_one(torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    """2 ranks, EP=2 (each holds 2 of the 4 experts) against EP=1 (DP=2, every rank all experts): the same
    metrics to 1e-6 over 3 learning steps, and the engine's log-probs agree with the actor's at every step (the
    experts reach the engine). ~40 s: two 2-rank launches."""
    moe = {**tiny, "model": make_tiny_model(tiny["tmp"] / "moe_model", arch="qwen3_moe", hidden=64, layers=2,
                                            heads=4, kv_heads=2, max_positions=128,
                                            moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))}
    runs = {}
    for ep in (1, 2):
        out = tiny["tmp"] / f"moe_ep{ep}"
        torchrun([TRAIN, *overrides(moe, out, *KEYWORD, "trainer.val_before_train=false", "trainer.test_freq=0",
                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                    f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}")], nproc=2,
                 timeout=600)
        runs[ep] = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in runs[2]] == [1, 2, 3]
    assert runs[1][0]["actor/grad_norm"] > 0.1  # a real update
    for a, b in zip(runs[2], runs[1], strict=True):
        assert a["rollout/logprob_abs_diff"] <= 1e-5
        for k in b:
            if not k.startswith(("timing", "perf/")):
                assert math.isclose(a[k], b[k], rel_tol=0, abs_tol=1e-6), (a["step"], k, a[k], b[k])


@pytest.mark.distributed
def test_an_r3_run_resumes_bitwise(torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    """2 ranks at EP=2, ``actor.router_replay.mode=R3``, 2 mini-batches a step (the old-log-prob pass runs): every
    update reports its replay, the trainer routes as the engine did (fp32: no pair differs), and a run resumed from
    its step-2 checkpoint gives step 3 exactly (the routing is per step, never saved; R2's is recomputed each step
    the same way, and its replay is checked in ``megatron/test_router_replay.py``). The responses vary in length
    from rank to rank. ~50 s: two 2-rank launches."""
    random = make_tiny_model(tiny["tmp"] / "moe_replay_random", arch="qwen3_moe", hidden=64, layers=2, heads=4,
                             kv_heads=2, max_positions=128,
                             moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    # responses end at EOS early and unevenly: each rank's rows have another length, which the EP ranks' token
    # exchange must not see (the runner pads to the longest over the EP group)
    moe = {**tiny, "model": chatty(random, tiny["tmp"] / "moe_replay_model")}
    out = tiny["tmp"] / "replay_R3"
    args = [*KEYWORD, "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.actor.router_replay.mode=R3"]
    torchrun([TRAIN, *overrides(moe, out, *args)], nproc=2, timeout=600)
    reference = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in reference] == [1, 2, 3]
    for r in reference:
        assert 0.0 <= r["actor/router_replay_mismatch"] <= 1.0
        assert r["router_replay/engine_mismatch"] == 0.0 and r["rollout/logprob_abs_diff"] <= 1e-5
    resumed = tiny["tmp"] / "replay_R3_resumed"
    shutil.copytree(out, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000003")
    torchrun([TRAIN, *overrides(moe, resumed, *args)], nproc=2, timeout=600)
    again = [r for r in read_metrics(resumed) if r["step"] > 0]
    assert [r["step"] for r in again] == [1, 2, 3]
    strip = [{k: v for k, v in r.items() if not k.startswith(("timing", "perf/"))} for r in (reference[2], again[2])]
    assert strip[0] == strip[1]


def test_an_expert_parallel_checkpoint_does_not_load_at_ep1(tmp_path: Path) -> None:
    """Megatron chains the optimizer of expert parallelism (dense and expert groups) and not at EP=1: resuming
    across is refused naming the key and what to set, before dist_checkpointing's KeyError."""
    from types import SimpleNamespace

    from hybridrl.checkpoint.rl import _check_expert_layout

    key = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"
    (tmp_path / "config.yaml").write_text("actor_rollout_ref:\n  actor:\n    megatron:\n"
                                          "      expert_model_parallel_size: 2\n")
    policy = SimpleNamespace(arch=SimpleNamespace(moe=object()), parallel=SimpleNamespace(expert_model_parallel_size=1))
    with pytest.raises(ValueError, match=rf"{key}=1: .* was saved at {key}=2; .*resume with {key}=a value > 1"):
        _check_expert_layout(tmp_path, policy)  # type: ignore[arg-type]
    policy.parallel.expert_model_parallel_size = 4  # EP>1 to EP>1: the same chained layout, no refusal
    _check_expert_layout(tmp_path, policy)  # type: ignore[arg-type]
    dense = SimpleNamespace(arch=SimpleNamespace(moe=None), parallel=SimpleNamespace(expert_model_parallel_size=1))
    _check_expert_layout(tmp_path, dense)  # type: ignore[arg-type]
