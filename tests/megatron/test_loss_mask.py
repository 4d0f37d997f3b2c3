"""``loss_mask``: tokens that are attended but not trained on (a tool's output in a multi-turn response).

Causal attention makes a response's trailing tokens invisible to the logits of the tokens before them, so an
RL step on a batch whose responses end in ``k`` untrained tokens (in ``response_mask``, not in ``loss_mask``)
must equal the step on the same batch with those tokens cut off: the loss, every normaliser (token-mean and
seq-mean-token-mean count ``loss_mask``), entropy, KL-to-ref, the metrics and the weights after the step (SGD:
the update is the gradient itself). Run on real Megatron (one gloo rank, a tiny Qwen2). With a hole (an
untrained token *between* trained ones) the step's loss is the on-policy PPO loss averaged over ``loss_mask``
alone, computed here from the batch.

This file is also the rank's worker (``python -m torch.distributed.run … test_loss_mask.py MODEL OUT``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

TOL = 2e-6  # fp32 reassociation: the cut batch's rows are shorter
METRICS = ("pg_loss", "grad_norm", "ppo_kl", "clipfrac", "entropy", "kl_ref")
MODES = ("token-mean", "seq-mean-token-mean")


sys.path.insert(0, str(Path(__file__).parent))  # test_on_policy's config, batch and model (run as a script too)
from test_on_policy import model  # noqa: E402, F401  (a fixture)


def _config(model_dir: str, mode: str):
    from test_on_policy import _config as on_policy_config

    cfg = on_policy_config(model_dir, pp=1, mini_prompts=4)
    a = cfg.actor_rollout_ref.actor
    a.loss_agg_mode, a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type = mode, True, 0.1, "low_var_kl"
    return cfg


def _batches(model_dir: str):
    """The layout tests' fixed batch with untrained tails (2 tokens of every response of ≥ 3), the same batch
    cut after its trained tokens, and the batch with an untrained hole (its second token) instead."""
    from test_on_policy import _batch

    full = _batch(model_dir)
    lengths_B = full.response_mask.sum(-1)
    trained_B = torch.where(lengths_B >= 3, lengths_B - 2, lengths_B)
    t_1T = torch.arange(full.response_ids.shape[1])[None]
    loss_mask_BT = (t_1T < trained_B[:, None]).long()
    tails = dataclasses.replace(full, loss_mask=loss_mask_BT)
    cut = dataclasses.replace(full, response_ids=torch.where(loss_mask_BT.bool(), full.response_ids, full.pad_token_id),
                              response_mask=loss_mask_BT.clone(), loss_mask=loss_mask_BT.clone(),
                              rollout_logprobs=full.rollout_logprobs * loss_mask_BT,
                              advantages=full.advantages * loss_mask_BT)
    hole_BT = full.response_mask.clone()
    hole_BT[lengths_B >= 3, 1] = 0
    hole = dataclasses.replace(full, loss_mask=hole_BT)
    zeroed = dataclasses.replace(full, advantages=full.advantages * hole_BT)
    return {"tails": tails, "cut": cut, "hole": hole, "full": full, "zeroed_hole": zeroed}


def _step(model_dir: str, mode: str, batch) -> dict:
    import torch.distributed as dist

    from hybridrl.config.plan import Plan
    from hybridrl.hybrid import ActorRolloutRef
    from hybridrl.megatron.parallel import seed_everything
    from hybridrl.trainers.components import actor_objective

    seed_everything(1)
    cfg = _config(model_dir, mode)
    plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
    assert not problems, problems
    hybrid = ActorRolloutRef(cfg.actor_rollout_ref, plan=plan, objective=actor_objective(cfg),
                             pad_token_id=batch.pad_token_id)
    hybrid.compute_log_probs(batch)
    hybrid.compute_ref_log_probs(batch)
    steps = hybrid.update_actor(batch, seed=7)
    weights = {k: v.clone() for bucket in hybrid.actor.export_weights(bucket_bytes=1 << 20) for k, v in bucket}
    return {"steps": steps, "weights": weights}


def main() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hybridrl.megatron.parallel import ParallelConfig, init_parallel

    torch.set_num_threads(1)
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    init_parallel(ParallelConfig())
    result = {mode: {name: _step(model_dir, mode, b) for name, b in _batches(model_dir).items()} for mode in MODES}
    torch.save(result, out)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def steps(torchrun, model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    out = tmp_path_factory.mktemp("loss_mask") / "result.pt"
    torchrun([__file__, str(model), str(out)], nproc=1, timeout=600)
    return torch.load(out, weights_only=False)


def _differences(a: dict, b: dict) -> dict[str, float]:
    out = {k: abs(a["steps"][0][k] - b["steps"][0][k]) for k in METRICS}
    out["weights"] = max(float((a["weights"][k] - b["weights"][k]).abs().max()) for k in a["weights"])
    return out


def _expected_pg_loss(batch, mode: str) -> float:
    """The on-policy PPO loss (ratio 1): −A averaged over ``loss_mask`` as ``mode`` says."""
    m_BT = batch.loss_mask.float()
    if mode == "token-mean":
        return float(-(batch.advantages * m_BT).sum() / m_BT.sum())
    return float(-((batch.advantages * m_BT).sum(-1) / m_BT.sum(-1)).mean())


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_untrained_tail_gives_the_step_of_the_cut_batch(steps: dict, mode: str) -> None:
    r = steps[mode]
    assert len(r["tails"]["steps"]) == 1 and r["tails"]["steps"][0]["grad_norm"] > 1e-3
    diffs = _differences(r["tails"], r["cut"])
    assert all(v <= TOL for v in diffs.values()), diffs
    assert _differences(r["tails"], r["full"])["grad_norm"] > 1e-2  # the tails would have been trained on


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_normaliser_count_only_trained_tokens(steps: dict, model: Path, mode: str) -> None:  # noqa: F811
    """With an untrained hole (a token between trained ones) or tail, the step's loss is the mean over
    ``loss_mask`` alone — not over ``response_mask`` (the full mask's), nor with the hole's advantage merely
    zeroed (which still counts it in the normaliser)."""
    batches, r = _batches(str(model)), steps[mode]
    for name in ("hole", "tails", "full"):
        got = r[name]["steps"][0]["pg_loss"]
        assert abs(got - _expected_pg_loss(batches[name], mode)) <= TOL, (name, got)
    assert abs(_expected_pg_loss(batches["hole"], mode) - _expected_pg_loss(batches["zeroed_hole"], mode)) > 1e-3
    assert _differences(r["hole"], r["zeroed_hole"])["grad_norm"] > 1e-2


if __name__ == "__main__":
    main()
