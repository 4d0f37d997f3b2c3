"""PPO with a critic end to end: ``launch/train.py recipe=ppo_tiny`` (gae advantages) for a few steps, and a
resume from a checkpoint that holds the critic (bitwise the uninterrupted run)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from support.e2e import TRAIN, read_metrics, tiny  # noqa: F401  (tiny is a fixture)

from hybridrl.checkpoint.rl import LATEST

CRITIC_KEYS = {"critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
               "critic/grad_norm", "timing/values", "timing/update_critic"}


@pytest.mark.distributed
def test_ppo_tiny_trains_actor_and_critic(torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    out = tiny["tmp"] / "ppo"
    keyword = ["reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any"]
    proc = torchrun([TRAIN, "recipe=ppo_tiny", f"actor_rollout_ref.model.path={tiny['model']}",
                     "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{tiny['train']}]",
                     f"data.val_files=[{tiny['test']}]", "data.build_if_missing=null", f"trainer.output_dir={out}",
                     "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=4",
                     "critic.ppo_micro_batch_size_per_gpu=2", "critic.optim.lr=1e-3", "data.val_batch_size=64",
                     "trainer.total_training_steps=3", "trainer.test_freq=0", "trainer.val_before_train=false",
                     # verl's key: step 1 trains the critic alone, the actor updates from step 2 on
                     "trainer.critic_warmup=2",
                     # the critic's state waits in host memory while the engine generates (the CPU runs the same path)
                     "critic.megatron.param_offload=true", "critic.megatron.grad_offload=true",
                     "critic.megatron.optimizer_offload=true", *keyword], nproc=1)
    assert "critic  TP=1 PP=1 CP=1 DP=1" in proc.stdout  # the plan places it
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert CRITIC_KEYS <= r.keys(), CRITIC_KEYS - r.keys()
        assert all(math.isfinite(v) for v in r.values()), r
        assert r["critic/grad_norm"] > 0
    assert "timing/update_actor" not in rows[0] and "actor/pg_loss" not in rows[0]  # the critic's warmup step
    for r in rows[1:]:
        assert abs(r["actor/ppo_kl_first_mb"]) <= 1e-6 and "timing/update_actor" in r
    # the critic learns the reward: scores are 0 or 1, so its values climb from the random head's ~0
    assert 0 < rows[0]["critic/vpred_mean"] < rows[-1]["critic/vpred_mean"]


def ppo(tiny: dict[str, Path], out: Path, *extra: str) -> list[str]:  # noqa: F811
    return [TRAIN, "recipe=ppo_tiny", f"actor_rollout_ref.model.path={tiny['model']}",
            "actor_rollout_ref.model.build_if_missing=null", f"data.train_files=[{tiny['train']}]",
            "data.val_files=[]", "data.build_if_missing=null", f"trainer.output_dir={out}",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_mini_batch_size=4",
            "critic.ppo_micro_batch_size_per_gpu=2", "critic.optim.lr=1e-3", "reward.name=keyword",
            "+reward.kwargs.keywords=[a,e,i,o,u,t,n,s]", "+reward.kwargs.mode=any", *extra]


@pytest.mark.distributed
def test_ppo_resumes_actor_and_critic_bitwise(torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    reference, resumed = tiny["tmp"] / "ppo_ref", tiny["tmp"] / "ppo_resumed"
    steps = ("trainer.total_training_steps=4", "trainer.save_freq=2")
    torchrun(ppo(tiny, reference, *steps), nproc=1)
    ckpts = reference / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [LATEST, "step_00000002", "step_00000004"]
    assert (ckpts / "step_00000002" / "critic").is_dir()
    shutil.copytree(reference, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    proc = torchrun(ppo(tiny, resumed, *steps), nproc=1)  # trainer.resume=auto picks step 2
    assert "resuming from" in proc.stdout and "step_00000002" in proc.stdout

    def rows(out: Path) -> dict[int, dict[str, float]]:
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing", "perf"))}
                for r in read_metrics(out)}

    ref, got = rows(reference), rows(resumed)
    assert got[4]["critic/vf_loss"] > 0 and got == ref  # steps 3, 4 recomputed: critic values, losses, grad norms
