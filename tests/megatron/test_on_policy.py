"""The on-policy shortcut: no old-log-prob pass when the update provably is on-policy, same step as with it.

With one PPO epoch of one mini-batch the update's forward runs on the weights the old log-probs come
from, so π_old = π (detached) and the pass is skipped (``ActorRolloutRef.update_actor_on_policy``, as TRL
and verl do). Checked on real Megatron (gloo ranks, a tiny Qwen2): one step with the pass
(``compute_log_probs`` → ``update_actor``) and one without, from the same weights on the same batch, give
the same loss, grad norm, metrics, π_old and weights after the step (fp32 reassociation only: the pass
uses its own micro-batches, in eval mode) at TP=1 and at PP=2 (results broadcast from the last stage);
the shortcut refuses a plan of two mini-batches or two epochs; and the loop picks the pass exactly when
the plan or ``algorithm.use_kl_in_reward`` needs it (``trainer.old_log_prob_pass_needed``).

This file is also the ranks' worker (``python -m torch.distributed.run … test_on_policy.py MODEL OUT LAYOUT``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: this file is also run as a rank's script
from support.e2e import tiny  # noqa: E402, F401  (a fixture)

METRICS = ("pg_loss", "grad_norm", "ppo_kl", "clipfrac", "entropy")
TOL = 2e-6  # fp32 reassociation (the pass and the update cut different micro-batches)


def _config(model_dir: str, *, pp: int, mini_prompts: int, epochs: int = 1, shared: bool = False):
    from hybridrl.config.schema import RLConfig

    cfg = RLConfig()
    aor = cfg.actor_rollout_ref
    aor.model.path = model_dir
    for m in (aor.actor.megatron, aor.ref.megatron):
        m.pipeline_model_parallel_size = pp
    a = aor.actor
    a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, a.ppo_epochs = mini_prompts, 4, epochs
    a.shuffle = True  # the shortcut must take the same sample order as update_actor
    a.loss_agg_mode, a.entropy_coeff, a.use_kl_loss = "token-mean", 0.01, False
    a.use_prefix_grouper = shared  # a prompt's samples in one row (megatron/prefix_grouper.py)
    a.optim.optimizer, a.optim.lr, a.optim.clip_grad = "sgd", 0.5, 1.0  # the update is the gradient itself
    aor.rollout.n, aor.rollout.temperature, aor.rollout.log_prob_micro_batch_size_per_gpu = 4, 0.9, 6
    cfg.algorithm.policy_loss = "ppo_clip"
    cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length = 4, 9, 10
    cfg.trainer.total_training_steps = 1
    return cfg


def _batch(model_dir: str):
    """The layout tests' fixed batch: 4 prompts × 4 samples of differing lengths, fixed advantages."""
    from transformers import AutoConfig

    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel" / "workers"))
    from rl_step import fixed_batch

    hf = AutoConfig.from_pretrained(model_dir)
    return fixed_batch(hf.vocab_size, hf.pad_token_id)


def _step(model_dir: str, pp: int, *, shortcut: bool, shared: bool = False) -> dict:
    import torch.distributed as dist

    from hybridrl.config.plan import Plan
    from hybridrl.hybrid import ActorRolloutRef
    from hybridrl.megatron.parallel import seed_everything
    from hybridrl.trainers.components import actor_objective

    seed_everything(1)
    cfg = _config(model_dir, pp=pp, mini_prompts=4, shared=shared)
    plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
    assert not problems, problems
    batch = _batch(model_dir)
    hybrid = ActorRolloutRef(cfg.actor_rollout_ref, plan=plan, objective=actor_objective(cfg),
                             pad_token_id=batch.pad_token_id)
    assert hybrid.update_is_on_policy
    if shortcut:
        steps, entropy_BT = hybrid.update_actor_on_policy(batch, seed=7)
    else:
        entropy_BT = hybrid.compute_log_probs(batch)
        steps = hybrid.update_actor(batch, seed=7)
    weights = {k: v.clone() for bucket in hybrid.actor.export_weights(bucket_bytes=1 << 20) for k, v in bucket}
    return {"steps": steps, "old": batch.old_logprobs, "entropy": entropy_BT, "weights": weights}


def _refusals(model_dir: str) -> list[str]:
    import torch.distributed as dist

    from hybridrl.config.plan import Plan
    from hybridrl.hybrid import ActorRolloutRef
    from hybridrl.trainers.components import actor_objective

    said = []
    for mini, epochs in ((2, 1), (4, 2)):
        cfg = _config(model_dir, pp=1, mini_prompts=mini, epochs=epochs)
        plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
        assert not problems, problems
        batch = _batch(model_dir)
        hybrid = ActorRolloutRef(cfg.actor_rollout_ref, plan=plan, objective=actor_objective(cfg),
                                 pad_token_id=batch.pad_token_id)
        assert not hybrid.update_is_on_policy
        before = [p.detach().clone() for p in hybrid.actor.parameters()]
        try:
            hybrid.update_actor_on_policy(batch, seed=7)
        except ValueError as e:
            said.append(str(e))
        assert all(torch.equal(a, p) for a, p in zip(before, hybrid.actor.parameters(), strict=True))
        assert batch.old_logprobs is None
    return said


def main() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hybridrl.megatron.parallel import ParallelConfig, init_parallel

    torch.set_num_threads(1)
    model_dir, out, pp = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    init_parallel(ParallelConfig(pipeline_model_parallel_size=pp))
    result = {"with_pass": _step(model_dir, pp, shortcut=False), "shortcut": _step(model_dir, pp, shortcut=True),
              "shortcut_shared": _step(model_dir, pp, shortcut=True, shared=True)}
    if pp == 1:
        result["refusals"] = _refusals(model_dir)
    if dist.get_rank() == dist.get_world_size() - 1:  # every rank holds the results: check the last stage's
        torch.save(result, out)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, discriminate) -> Path:
    from hybridrl.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("on_policy") / "tiny-qwen2"
    make_tiny_model(out, arch="qwen2", hidden=64, layers=4, heads=4, kv_heads=2, max_positions=128, tie=True, seed=3)
    return discriminate(out, seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [1, 2])
def test_shortcut_gives_the_same_step(torchrun, model: Path, tmp_path: Path, pp: int) -> None:
    """Same metrics, π_old, entropy and weights with and without the old-log-prob pass (SGD: the update is
    the clipped gradient, so a gradient difference shows in the weights); also with shared-prompt rows."""
    out = tmp_path / "result.pt"
    torchrun([__file__, str(model), str(out), str(pp)], nproc=pp, timeout=600)
    r = torch.load(out, weights_only=False)
    for shortcut in ("shortcut", "shortcut_shared"):
        _check_same_step(r["with_pass"], r[shortcut])


def _check_same_step(ref: dict, got: dict) -> None:
    assert len(ref["steps"]) == len(got["steps"]) == 1
    for k in METRICS:
        assert abs(ref["steps"][0][k] - got["steps"][0][k]) <= TOL * max(1.0, abs(ref["steps"][0][k])), k
    assert got["steps"][0]["ppo_kl"] == 0.0 and got["steps"][0]["clipfrac"] == 0.0  # ratio exactly 1
    assert ref["steps"][0]["grad_norm"] > 1e-3  # a real update happened
    assert got["old"] is not None and torch.allclose(got["old"], ref["old"], rtol=0, atol=TOL)
    assert bool((got["old"] != 0).any())
    assert torch.allclose(got["entropy"], ref["entropy"], rtol=0, atol=TOL)
    moved = max(float((ref["weights"][k] - got["weights"][k]).abs().max()) for k in ref["weights"])
    assert moved <= TOL


@pytest.mark.slow
def test_shortcut_refuses_an_update_that_is_not_provably_on_policy(torchrun, model: Path, tmp_path: Path) -> None:
    """Two mini-batches, or two epochs: a clear error, no weight touched, no π_old filled in."""
    out = tmp_path / "result.pt"
    torchrun([__file__, str(model), str(out), "1"], nproc=1, timeout=600)
    said = torch.load(out, weights_only=False)["refusals"]
    assert len(said) == 2
    assert "2 mini-batches per epoch" in said[0] and "ppo_epochs=2" in said[1]


@pytest.mark.parametrize(("mini", "epochs", "kl_in_reward", "estimator", "needed"), [
    (4, 1, False, "grpo", False),  # one epoch, one mini-batch: the shortcut
    (2, 1, False, "grpo", True),  # two mini-batches: the second runs on updated weights
    (4, 2, False, "grpo", True),  # two epochs
    (4, 1, True, "grpo", True),  # π_old read before the update (KL in the reward)
    (4, 1, False, "opd", True),  # π_old read before the update (the distillation advantage)
])
def test_the_loop_runs_the_pass_only_when_needed(mini: int, epochs: int, kl_in_reward: bool, estimator: str,
                                                 needed: bool) -> None:
    from hybridrl.config.plan import Plan
    from hybridrl.hybrid import ActorRolloutRef
    from hybridrl.registry import Registry
    from hybridrl.trainers.rl import old_log_prob_pass_needed

    cfg = _config("unused", pp=1, mini_prompts=mini, epochs=epochs)
    cfg.algorithm.use_kl_in_reward = kl_in_reward
    plan, problems = Plan.build(cfg, world_size=1, device_type="cpu")
    assert not problems, problems
    hybrid = SimpleNamespace(plan=plan)  # the property reads only the plan: no model built
    on_policy = ActorRolloutRef.update_is_on_policy.fget(hybrid)  # type: ignore[attr-defined]
    c = SimpleNamespace(cfg=cfg, hybrid=SimpleNamespace(update_is_on_policy=on_policy),
                        estimator=Registry("advantage_estimators").build(estimator, {}, key="algorithm.adv_estimator"))
    assert old_log_prob_pass_needed(c) is needed  # type: ignore[arg-type]


@pytest.mark.distributed
def test_the_loop_skips_the_pass_and_keeps_its_metrics(torchrun, tiny: dict[str, Path]) -> None:  # noqa: F811
    """launch/train.py with one mini-batch per step: no old-log-prob pass (``actor/old_logprob_pass`` 0, no
    ``timing/old_log_prob``), π_old from the update still checked against the engine's log-probs."""
    from support.e2e import TRAIN, base_overrides, read_metrics

    out = tiny["tmp"] / "on_policy_run"
    torchrun([TRAIN, *base_overrides(
        tiny, out, "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.use_kl_loss=false", "reward.name=keyword", "+reward.kwargs.keywords=[a,e,i,o,u]",
        "+reward.kwargs.mode=any", "data.val_files=[]", "trainer.total_training_steps=2", "trainer.test_freq=0")],
        nproc=1)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["actor/old_logprob_pass"] == 0.0 and "timing/old_log_prob" not in r
        assert r["actor/ppo_kl"] == 0.0 and r["actor/clipfrac"] == 0.0  # π_old = π exactly
        assert r["rollout/logprob_abs_diff"] <= 1e-4  # present: π_old filled in from the update's forward
        assert r["actor/grad_norm"] > 0


if __name__ == "__main__":
    main()
