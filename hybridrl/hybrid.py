"""``ActorRolloutRef``: the actor, the reference model and the rollout engine of one colocated group.

Who does what (every rank runs this same code):
- Megatron actor and ref span the whole world with their TP/PP/(CP)/DP layout.
- The rollout engine lives on the first rank of each model-parallel group (the ranks that share a
  DP index). It generates that DP shard's prompts; the samples are broadcast to the group, so after
  ``generate`` every rank holds the same ``RolloutBatch`` as its model-parallel peers.
- Phases: the engine resumes its memory to generate and releases it before training.
- Weight sync: the actor's bucketed HF-named stream (TP-gathered, PP-broadcast, identical on every
  rank) is copied into the engine's parameters in place, then the weight version is bumped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hybridrl.algorithms.actor_objective import ActorObjective
from hybridrl.algorithms.loss_agg import local_normalizer
from hybridrl.batch import RolloutBatch
from hybridrl.config.schema import RefConfig, RLConfig, RolloutConfig
from hybridrl.config.topology import ref_needed
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import Generation, RolloutEngine, SamplingParams
from hybridrl.megatron.policy import MegatronPolicy
from hybridrl.registry import Registry
from hybridrl.rollout.batching import rollout_batch_from_generations


class ActorRolloutRef:
    def __init__(self, cfg: RLConfig, *, pad_token_id: int, device: torch.device, model_path: str) -> None:
        aor = cfg.actor_rollout_ref
        self.cfg = cfg
        self.pad_token_id = pad_token_id
        total = cfg.trainer.total_training_steps * cfg.actor_rollout_ref.actor.ppo_epochs * max(
            cfg.data.train_batch_size // aor.actor.ppo_mini_batch_size, 1)
        self.actor = MegatronPolicy(model_dir=model_path, megatron=aor.actor.megatron, optim=aor.actor.optim,
                                    total_steps=total, pad_token_id=pad_token_id)
        self.ref = (MegatronPolicy(model_dir=model_path, megatron=aor.ref.megatron, optim=None, total_steps=0,
                                   pad_token_id=pad_token_id) if ref_needed(cfg) else None)
        self.group, self.leader = _model_parallel_group()
        self.engine: RolloutEngine | None = None
        if dist.get_rank() == self.leader:
            self.engine = Registry("rollout_engines").build(
                aor.rollout.name, aor.rollout.engine_kwargs, key="actor_rollout_ref.rollout.engine_kwargs",
                model_path=model_path, device=device, tp_size=aor.rollout.tensor_model_parallel_size)
        self.weight_version = 0
        self.objective = ActorObjective(
            policy_loss=Registry("policy_losses").build(cfg.algorithm.policy_loss, cfg.algorithm.policy_loss_kwargs,
                                                        key="algorithm.policy_loss_kwargs"),
            loss_agg_mode=aor.actor.loss_agg_mode, entropy_coeff=aor.actor.entropy_coeff,
            use_kl_loss=aor.actor.use_kl_loss, kl_loss_coef=aor.actor.kl_loss_coef,
            kl_loss_type=aor.actor.kl_loss_type)

    # ---- generate phase ----
    def generate(self, prompts: PromptBatch, params: SamplingParams) -> RolloutBatch:
        generations: list[Any] = [None]
        if self.engine is not None:
            self.engine.resume_memory()
            generations[0] = self.engine.generate(prompts.token_lists(), params)
            self.engine.release_memory()
        if self.group is not None:
            dist.broadcast_object_list(generations, src=self.leader, group=self.group)
        gens: list[Generation] = generations[0]
        return rollout_batch_from_generations(prompts, gens, pad_token_id=self.pad_token_id)

    # ---- train phase ----
    def compute_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        """Fill ``batch.old_logprobs`` (actor, before the update); return the entropy ``[B, T]``."""
        r = self.cfg.actor_rollout_ref.rollout
        batch.old_logprobs, entropy_BT = self.actor.compute_log_probs(
            batch, micro_batch_size=r.log_prob_micro_batch_size_per_gpu, max_tokens=self._log_prob_budget(r),
            temperature=_logprob_temperature(r.temperature))
        return entropy_BT

    def compute_ref_log_probs(self, batch: RolloutBatch) -> None:
        assert self.ref is not None
        ref = self.cfg.actor_rollout_ref.ref
        batch.ref_logprobs, _ = self.ref.compute_log_probs(
            batch, micro_batch_size=ref.log_prob_micro_batch_size_per_gpu, max_tokens=self._log_prob_budget(ref),
            temperature=_logprob_temperature(self.cfg.actor_rollout_ref.rollout.temperature))

    def update_actor(self, batch: RolloutBatch, *, seed: int) -> list[dict[str, float]]:
        """PPO epochs over mini-batches of this DP rank's samples; one metrics dict per optimizer step."""
        a = self.cfg.actor_rollout_ref.actor
        n = self.cfg.actor_rollout_ref.rollout.n
        share = a.ppo_mini_batch_size * n // parallel_state.get_data_parallel_world_size()
        gen = torch.Generator().manual_seed(seed)
        steps = []
        for _ in range(a.ppo_epochs):
            order = torch.randperm(len(batch), generator=gen) if a.shuffle else torch.arange(len(batch))
            for mini in batch.index(order).split(share):
                normalizer = local_normalizer(mini.response_mask, a.loss_agg_mode).double()
                dist.all_reduce(normalizer, group=parallel_state.get_data_parallel_group())

                def loss_fn(logp: torch.Tensor, ent: torch.Tensor, mb: RolloutBatch,
                            norm: torch.Tensor = normalizer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                    return self.objective(logp, ent, mb, normalizer=norm.clamp_min(1).float())

                steps.append(self.actor.train_step(
                    mini, loss_fn, micro_batch_size=a.ppo_micro_batch_size_per_gpu,
                    max_tokens=a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None,
                    temperature=_logprob_temperature(self.cfg.actor_rollout_ref.rollout.temperature)))
        return steps

    def _log_prob_budget(self, role: RolloutConfig | RefConfig) -> int | None:
        """Token budget of a log-prob pass (``None``: fixed-size micro-batches); unset keys follow the actor."""
        a = self.cfg.actor_rollout_ref.actor
        dynamic = a.use_dynamic_bsz if role.log_prob_use_dynamic_bsz is None else role.log_prob_use_dynamic_bsz
        return (role.log_prob_max_token_len_per_gpu or a.ppo_max_token_len_per_gpu) if dynamic else None

    def sync_weights(self) -> float:
        """Stream the actor's weights into the engine in place; return the MB streamed."""
        self.weight_version += 1
        bucket_bytes = self.cfg.actor_rollout_ref.rollout.update_weights_bucket_megabytes << 20
        sent = 0

        def counted(stream: Any) -> Any:
            nonlocal sent
            for bucket in stream:
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                yield bucket

        stream = counted(self.actor.export_weights(bucket_bytes=bucket_bytes))
        if self.engine is not None:
            self.engine.update_weights(stream, version=self.weight_version)
        for _ in stream:  # ranks without an engine still take part in the export's collectives
            pass
        return sent / 2**20

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _logprob_temperature(t: float) -> float:
    """The engine reports log-probs under softmax(logits / T) (T=0: greedy, untempered)."""
    return t if t > 0 else 1.0


def _model_parallel_group() -> tuple[dist.ProcessGroup | None, int]:
    """The ranks sharing this rank's DP index (TP × CP × PP), and the first of them (the engine leader)."""
    world = dist.get_world_size()
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_ranks = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    # every rank builds the same groups (new_group is collective): group k = ranks at DP position k
    all_dp_groups: list[list[int]] = [[] for _ in range(dp_size)]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (dist.get_rank(), dp_ranks.index(dist.get_rank())))
    for rank, dp_index in gathered:
        all_dp_groups[dp_index].append(rank)
    mine = None
    for ranks in all_dp_groups:
        g = dist.new_group(ranks=sorted(ranks)) if len(ranks) > 1 else None
        if dist.get_rank() in ranks:
            mine = (g, min(ranks))
    assert mine is not None
    return mine
