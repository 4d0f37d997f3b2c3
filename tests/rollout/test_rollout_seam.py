"""The rollout seam (``hybridrl.interfaces.Rollout``): the loop asks a rollout for a step's scored batch.

- ``rollout/build.py`` picks the kind from config: the single-turn rollout, wrapped by dynamic sampling under
  ``algorithm.filter_groups.enable``; both satisfy the protocol.
- Dynamic sampling wraps *any* rollout: here a scripted one defined in this file (as a third party's multi-turn
  or asynchronous rollout would be) on 2 gloo ranks: rounds of the inner rollout's steps, seeded
  ``seed + r·2³²``, until the step holds ``data.train_batch_size`` groups with signal, gathered over DP and cut
  into this rank's share; evaluation and weight sync go to the inner rollout.

This file is also the ranks' worker (``python -m torch.distributed.run … test_rollout_seam.py OUT``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.config.plan import Plan
from hybridrl.config.schema import RLConfig
from hybridrl.interfaces import RewardOutput, Rollout, RolloutStep, Scored
from hybridrl.rewards.execution import PendingReward
from hybridrl.rollout.build import build_rollout
from hybridrl.rollout.dynamic_sampling import DynamicSamplingRollout
from hybridrl.rollout.single_turn import SingleTurnRollout
from hybridrl.seeds import ROUND_SEED_STRIDE

N, PROMPTS, PER_ROUND = 2, 2, 4  # samples per prompt; prompts per step; prompts per generation round
# round r's groups (prompt-major, 4 per round): 1 = the group's samples differ (signal), 0 = they are equal
ROUNDS = [[0, 1, 0, 0], [0, 0, 1, 1]]


def _config() -> RLConfig:
    cfg = RLConfig()
    cfg.actor_rollout_ref.model.path = "unused"
    cfg.actor_rollout_ref.rollout.n = N
    cfg.data.train_batch_size, cfg.data.gen_batch_size = PROMPTS, PER_ROUND
    actor = cfg.actor_rollout_ref.actor
    actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = PROMPTS, 1
    cfg.algorithm.filter_groups.enable, cfg.algorithm.filter_groups.metric = True, "score"
    cfg.algorithm.filter_groups.max_num_gen_batches = 4
    return cfg


class ScriptedRollout:
    """A rollout of fixed rounds: round ``r`` (from the seed) holds groups ``100·r + g``; this rank gets its DP
    half of the round's prompts. Records what it was asked."""

    def __init__(self, dp_rank: int, dp: int) -> None:
        self.dp_rank, self.dp, self.seeds, self.synced, self.version = dp_rank, dp, [], [], 0

    @property
    def weight_version(self) -> int:
        return self.version

    def step(self, *, seed: int, timer) -> RolloutStep:
        self.seeds.append(seed)
        r = (seed - 5) // ROUND_SEED_STRIDE
        share = range(self.dp_rank * PER_ROUND // self.dp, (self.dp_rank + 1) * PER_ROUND // self.dp)
        groups = [100 * r + g for g in share]
        scores = [float(i) if ROUNDS[r][g] else 1.0 for g in share for i in range(N)]
        b = len(groups) * N
        ones = torch.ones(b, 3, dtype=torch.long)
        batch = RolloutBatch(prompt_ids=ones[:, :2], prompt_mask=ones[:, :2], response_ids=ones, response_mask=ones,
                             rollout_logprobs=torch.zeros(b, 3), weight_version=torch.zeros(b, dtype=torch.long),
                             group_index=torch.tensor(groups).repeat_interleave(N), meta=[SampleMeta()] * b,
                             pad_token_id=0)
        scored = Scored(output=RewardOutput(scores_B=torch.tensor(scores)), errors=0)
        return RolloutStep(batch=batch, scores=PendingReward.finished(scored), metrics={"inner/ignored": 1.0})

    def generate(self, prompts, params, *, seed: int) -> RolloutBatch:
        return ("generated", seed)  # type: ignore[return-value]

    def sync_weights(self, *, version: int | None = None) -> float:
        self.version = self.version + 1 if version is None else version
        self.synced.append(self.version)
        return 1.5

    def shutdown(self) -> None:
        self.shut = True


def main() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hybridrl.megatron.parallel import ParallelConfig, init_parallel
    from hybridrl.metrics import Timer

    init_parallel(ParallelConfig())
    cfg = _config()
    plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
    assert not problems, problems
    inner = ScriptedRollout(plan.dp_rank_of(dist.get_rank()), plan.batch.dp)
    rollout = DynamicSamplingRollout(inner, cfg=cfg, plan=plan)
    assert isinstance(rollout, Rollout) and isinstance(inner, Rollout)
    timer = Timer()
    got = rollout.step(seed=5, timer=timer)
    out = {"groups": got.batch.group_index.tolist(), "scores": got.scores.result().output.scores_B.tolist(),
           "metrics": got.metrics, "seeds": inner.seeds, "timed": sorted(timer.times),
           "generate": rollout.generate(None, None, seed=9), "sync": rollout.sync_weights(),
           "version": rollout.weight_version, "synced": inner.synced}
    rollout.shutdown()  # the wrapper stops what the rollout it wraps owns
    out["shut"] = getattr(inner, "shut", False)
    torch.save(out, Path(sys.argv[1]) / f"rank{dist.get_rank()}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_build_rollout_wraps_the_single_turn_rollout_under_filter_groups() -> None:
    cfg = _config()
    plan, problems = Plan.build(cfg, world_size=1, device_type="cpu")
    assert not problems, problems
    workers = SimpleNamespace(weight_version=3)
    wrapped = build_rollout(cfg, plan, workers=workers, prompts=iter([]), position=dict, reward=None,  # type: ignore[arg-type]
                            tokenizer=None)
    assert isinstance(wrapped, DynamicSamplingRollout) and isinstance(wrapped.inner, SingleTurnRollout)
    assert isinstance(wrapped, Rollout) and wrapped.weight_version == 3
    cfg.algorithm.filter_groups.enable = False
    plain = build_rollout(cfg, plan, workers=workers, prompts=iter([]), position=dict, reward=None,  # type: ignore[arg-type]
                            tokenizer=None)
    assert isinstance(plain, SingleTurnRollout) and isinstance(plain, Rollout)
    assert plain.params.n == N and plain.params.max_new_tokens == cfg.data.max_response_length


@pytest.mark.slow
def test_dynamic_sampling_wraps_any_rollout_on_2_ranks(torchrun, tmp_path: Path) -> None:
    torchrun([__file__, str(tmp_path)], nproc=2, timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    # round 0 has one group with signal (1), round 1 two (102, 103): the step keeps 1 and 102, one per DP rank
    assert [r["groups"] for r in ranks] == [[1, 1], [102, 102]]
    assert [r["scores"] for r in ranks] == [[0.0, 1.0], [0.0, 1.0]]
    for r in ranks:
        assert r["seeds"] == [5, 5 + ROUND_SEED_STRIDE]  # round r: seed + r·2³²; the inner's metrics are its own
        assert r["metrics"] == {"dynamic_sampling/gen_rounds": 2.0, "dynamic_sampling/kept_groups": 3.0,
                                "dynamic_sampling/dropped_groups": 5.0, "dynamic_sampling/refilled_groups": 0.0}
        assert "timing/reward" in r["timed"]
        assert r["generate"] == ("generated", 9) and (r["sync"], r["version"], r["synced"]) == (1.5, 1, [1])
        assert r["shut"]


if __name__ == "__main__":
    main()
