"""``ActorRolloutRef``: the Megatron roles of a run — actor, reference, critic and distillation teacher.

Who does what (every rank runs this same code):
- Megatron actor, ref, critic and distillation teacher span the whole world with the actor's TP/PP/(CP)/DP layout
  (the others share the actor's process groups; the teacher is its own checkpoint, frozen like the ref, unless it
  runs on engine ranks of its own: ``teacher.inference``, :mod:`hybridrl.rollout.teacher_service`). With LoRA
  (``model.lora_rank`` > 0) the ref is the actor's own frozen base with its adapters off, and the weight sync sends
  the merged W + (alpha/r)·B·A. With ``rollout.placement=disaggregated`` they span the trainer ranks only.
- The rollout engines are not here: the rollout owns them (:mod:`hybridrl.rollout.workers`) and asks this class for
  the two things it needs, room to generate and the weights:
  - :meth:`ActorRolloutRef.offload_for_generation`: while the engines generate, the actor's and the critic's
    params/grads/optimizer state and the ref's params wait in host memory as the ``*_offload`` keys say
    (:mod:`hybridrl.megatron.offload`), each back on the device before it is used;
  - :meth:`ActorRolloutRef.weights_for_engines`: the actor's bucketed HF-named stream (TP-gathered, PP-broadcast,
    identical on every rank), checked finite first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from hybridrl.algorithms.actor_objective import ActorObjective
from hybridrl.batch import RolloutBatch
from hybridrl.config.plan import Plan
from hybridrl.config.schema import ActorRolloutRefConfig, CriticConfig
from hybridrl.distributed import dp_batches
from hybridrl.guards import require_finite
from hybridrl.interfaces import WeightBucket
from hybridrl.lora.config import LoRAConfig
from hybridrl.megatron.critic import MegatronCritic
from hybridrl.megatron.offload import PolicyOffload
from hybridrl.megatron.policy import MegatronPolicy, reference_log_probs, reference_policy
from hybridrl.rollout.teacher_service import RemoteTeacher


class ActorRolloutRef:
    def __init__(self, config: ActorRolloutRefConfig, *, plan: Plan, objective: ActorObjective,
                 pad_token_id: int, critic: CriticConfig | None = None, seed: int = 1,
                 balance_batch: bool = True, remote_teacher: RemoteTeacher | None = None) -> None:
        """``critic``: its config, when the plan has one (``seed`` draws its fresh value head);
        ``balance_batch``: ``trainer.balance_batch`` (:mod:`hybridrl.distributed.dp_batches`); ``remote_teacher``:
        the teacher's engines, when it runs on ranks of its own (the plan's ``teacher_engines``)."""
        self.config, self.plan, self.objective = config, plan, objective
        self.balance_batch = balance_batch
        a, model_dir = config.actor, config.model.path
        lora = LoRAConfig.from_model(config.model, key="actor_rollout_ref.model")
        self.actor = MegatronPolicy(model_dir=model_dir, megatron=a.megatron, optim=a.optim,
                                    total_steps=plan.batch.total_optimizer_steps, pad_token_id=pad_token_id, lora=lora,
                                    router_replay=a.router_replay.mode, freeze_vision_tower=a.freeze_vision_tower)
        self.ref = (reference_policy(self.actor, model_dir=model_dir, megatron=a.megatron, pad_token_id=pad_token_id)
                    if "ref" in plan.roles else None)
        _check_plan_matches_megatron(plan)
        m = a.megatron
        self.actor_offload = PolicyOffload(self.actor, params=m.param_offload, grads=m.grad_offload,
                                           optimizer=m.optimizer_offload)
        self.ref_offload = (PolicyOffload(self.ref, params=config.ref.megatron.param_offload)
                            if self.ref is not None and self.ref is not self.actor else None)
        self.teacher, self.teacher_offload = None, None
        if "teacher" in plan.roles:  # frozen, in the actor's layout, from its own checkpoint
            assert config.teacher.model.path is not None
            self.teacher = MegatronPolicy(model_dir=config.teacher.model.path, megatron=a.megatron, optim=None,
                                          total_steps=0, pad_token_id=pad_token_id)
            self.teacher_offload = PolicyOffload(self.teacher, params=config.teacher.megatron.param_offload)
        self.remote_teacher = remote_teacher
        self.teacher_loss = config.teacher.loss  # a supervised distillation term's (top-k: the teacher's pass)
        self.critic_config, self.critic, self.critic_offload = critic, None, None
        if "critic" in plan.roles:
            assert critic is not None and plan.batch.critic is not None, "the plan has a critic: pass its config"
            cm = critic.megatron.resolve(m)
            self.critic = MegatronCritic(model_dir=critic.model.path or model_dir, megatron=cm, optim=critic.optim,
                                         total_steps=plan.batch.critic.total_optimizer_steps,
                                         pad_token_id=pad_token_id, seed=seed)
            self.critic_offload = PolicyOffload(self.critic, params=cm.param_offload, grads=cm.grad_offload,
                                                optimizer=cm.optimizer_offload)
        r = config.rollout
        self.logprob_temperature = r.temperature if r.temperature > 0 else 1.0  # engines: T=0 is untempered

    @property
    def has_teacher(self) -> bool:
        return self.teacher is not None or self.remote_teacher is not None

    def close(self) -> None:
        if self.remote_teacher is not None:
            self.remote_teacher.shutdown()

    # ---- what the rollout needs of the trainer (hybridrl.rollout.workers.TrainerSide) ----
    def offload_for_generation(self) -> None:
        """The generate phase begins: the trainers' state waits in host memory as the ``*_offload`` keys say."""
        for offload in (self.actor_offload, self.ref_offload, self.teacher_offload, self.critic_offload):
            if offload is not None:
                offload.offload()

    def weights_for_engines(self, *, bucket_bytes: int) -> Iterator[WeightBucket]:
        """The actor's weights as HF-named buckets (collectives: every rank consumes the stream whole); never NaN."""
        self.actor_offload.reload("params")
        require_finite(self.actor.parameters(), what="the actor's weights")  # never ship NaN weights
        return self.actor.export_weights(bucket_bytes=bucket_bytes)

    # ---- train phase ----
    def compute_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        """Fill ``batch.old_logprobs`` (actor, before the update); return the entropy ``[B, T]``."""
        self.actor_offload.reload("params")
        batch.old_logprobs, entropy_BT = self.actor.compute_log_probs(
            batch, batching=self.plan.batch.old_log_prob, temperature=self.logprob_temperature, old_pass=True)
        return entropy_BT

    def take_routing_metrics(self) -> dict[str, float]:
        """The last old-log-prob pass's router replay metrics (``router_replay/*``), once."""
        out, self.actor.replay_metrics = self.actor.replay_metrics, {}
        return out

    def take_padding_metrics(self) -> dict[str, float]:
        """``perf/padding_share/<pass>``: the share of the positions each Megatron pass since the last call computed
        that were padding (over all DP ranks), once: ``old_log_prob``, ``update_actor``, ``ref``, ``teacher``,
        ``values``, ``update_critic`` (an evaluation's greedy pass counts with the actor's forward passes)."""
        names = {("actor", "forward"): "old_log_prob", ("actor", "update"): "update_actor", ("ref", "forward"): "ref",
                 ("teacher", "forward"): "teacher", ("critic", "forward"): "values",
                 ("critic", "update"): "update_critic"}
        runners = {"actor": self.actor, "ref": self.ref if self.ref is not self.actor else None,
                   "teacher": self.teacher, "critic": self.critic}
        out = {}
        for role, runner in runners.items():
            for kind, (real, computed) in sorted((runner.padding_tally if runner is not None else {}).items()):
                t = torch.tensor([real, computed], dtype=torch.float64, device=self.actor.device)
                dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
                out[f"perf/padding_share/{names[role, kind]}"] = 1.0 - float(t[0] / t[1].clamp(min=1))
            if runner is not None:
                runner.padding_tally = {}
        return out

    def compute_ref_log_probs(self, batch: RolloutBatch) -> None:
        assert self.ref is not None
        if self.ref_offload is None:  # LoRA: the actor's own base (megatron.policy.reference_policy)
            self.actor_offload.reload("params")
        else:
            self.ref_offload.reload()
        batch.ref_logprobs = reference_log_probs(self.ref, batch, batching=self.plan.batch.ref_log_prob,
                                                 temperature=self.logprob_temperature)
        if self.ref_offload is not None:
            self.ref_offload.offload()  # not needed again before the next step's

    def compute_teacher_log_probs(self, batch: RolloutBatch) -> None:
        """Fill ``batch.teacher_logprobs``: the distillation teacher's log-prob of every sampled token; with a top-k
        distillation loss (``teacher.loss``) ``batch.teacher_topk_{ids,logprobs}`` too, from the same pass (on the
        teacher's own engines when it has them)."""
        loss, temperature = self.teacher_loss, self.logprob_temperature
        if self.remote_teacher is not None:
            self.remote_teacher.score(batch, topk=loss.topk if loss.uses_topk else 0, temperature=temperature)
            return
        assert self.teacher is not None and self.teacher_offload is not None and self.plan.batch.teacher_log_prob
        self.teacher_offload.reload()
        batching = self.plan.batch.teacher_log_prob
        if loss.uses_topk:
            sampled_BT, topk_BTK, ids_BTK = self.teacher.compute_topk_log_probs(batch, loss.topk, batching=batching,
                                                                                temperature=temperature)
            batch.teacher_logprobs, batch.teacher_topk_logprobs, batch.teacher_topk_ids = sampled_BT, topk_BTK, ids_BTK
        else:
            batch.teacher_logprobs, _ = self.teacher.compute_log_probs(batch, batching=batching,
                                                                       temperature=temperature)
        self.teacher_offload.offload()

    def compute_values(self, batch: RolloutBatch) -> None:
        """Fill ``batch.values`` (the critic's, before its update)."""
        assert self.critic is not None and self.critic_offload is not None and self.plan.batch.critic is not None
        self.critic_offload.reload("params")
        batch.values = self.critic.compute_values(batch, batching=self.plan.batch.critic.update)

    def update_actor(self, batch: RolloutBatch, *, seed: int) -> list[dict[str, float]]:
        """PPO epochs over the step's mini-batches, this DP rank training its share of each (the same mini-batches
        at any DP size: :mod:`hybridrl.distributed.dp_batches`); one metrics dict per optimizer step."""
        a, b = self.config.actor, self.plan.batch
        self.actor_offload.reload()
        return dp_batches.epochs(batch.to(self.actor.device), lambda mini: self.actor.train_step(
            mini, self.objective, batching=b.update, loss_agg_mode=a.loss_agg_mode,
            temperature=self.logprob_temperature), dp=self._dp(), epochs=b.ppo_epochs,
            mini_batch=b.mini_batch_samples_per_dp_rank, order=_orderer(a.shuffle), seed=seed)

    def _dp(self) -> dp_batches.DPGroup:
        return dp_batches.DPGroup(rank=parallel_state.get_data_parallel_rank(),
                                  size=parallel_state.get_data_parallel_world_size(),
                                  group=parallel_state.get_data_parallel_group(), balance=self.balance_batch)

    @property
    def update_is_on_policy(self) -> bool:
        """One PPO epoch of one mini-batch: the update's single forward runs on the very weights the old
        log-probs would be computed with, so π_old = π (detached) exactly and the old-log-prob pass can go."""
        b = self.plan.batch
        return b.ppo_epochs == 1 and b.mini_batches_per_epoch == 1

    def update_actor_on_policy(self, batch: RolloutBatch, *, seed: int) -> tuple[list[dict[str, float]], torch.Tensor]:
        """``update_actor`` without the old-log-prob pass (``update_is_on_policy`` must hold; ``batch`` has no
        ``old_logprobs``): π_old is the update's own detached log-probs, filled into ``batch.old_logprobs``
        afterwards (so the rollout-vs-actor metrics stay); returns the metrics and the entropy ``[B, T]``."""
        if not self.update_is_on_policy:
            b = self.plan.batch
            raise ValueError(f"update_actor_on_policy: the update is not provably on-policy (actor.ppo_epochs="
                             f"{b.ppo_epochs}, {b.mini_batches_per_epoch} mini-batches per epoch; both must be 1)")
        a, b, dp = self.config.actor, self.plan.batch, self._dp()
        self.actor_offload.reload()
        local = batch.to(self.actor.device)
        tokens, starts = dp.tokens(local)  # one mini-batch: the whole step, split over DP as update_actor splits it
        order = _order(len(tokens), shuffle=a.shuffle, gen=torch.Generator().manual_seed(seed)).tolist()
        parts = dp.parts([tokens[g] for g in order])
        held, where = dp.fetch(local, starts, [sorted(order[i] for i in parts[r]) for r in range(dp.size)])
        mine = [order[i] for i in parts[dp.rank]]
        metrics, logp_BT, entropy_BT = self.actor.train_step_on_policy(
            held.index(torch.tensor([where[g] for g in mine], device=self.actor.device)), self.objective,
            batching=b.update, loss_agg_mode=a.loss_agg_mode, temperature=self.logprob_temperature)
        if dp.size > 1:
            metrics["dp_token_imbalance"] = dp_batches.imbalance([tokens[g] for g in order], parts)
        own, width = range(starts[dp.rank], starts[dp.rank] + len(local)), batch.response_ids.shape[1]
        batch.old_logprobs = dp.scatter_back(logp_BT, mine, total=len(tokens), local=own, width=width)
        return [metrics], dp.scatter_back(entropy_BT, mine, total=len(tokens), local=own, width=width)

    def update_critic(self, batch: RolloutBatch, *, seed: int) -> list[dict[str, float]]:
        """The critic's PPO epochs over its mini-batches of this DP rank's samples (``values``: V_old, and
        ``returns``); one metrics dict per optimizer step."""
        critic, c, b = self.critic, self.critic_config, self.plan.batch.critic
        assert critic is not None and self.critic_offload is not None and c is not None and b is not None
        self.critic_offload.reload()
        return dp_batches.epochs(batch.to(critic.device), lambda mini: critic.train_step(
            mini, batching=b.update, cliprange=c.cliprange_value, loss_agg_mode=c.loss_agg_mode), dp=self._dp(),
            epochs=b.ppo_epochs, mini_batch=b.mini_batch_samples_per_dp_rank, order=_orderer(c.shuffle), seed=seed)


def _orderer(shuffle: bool) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda n, gen: _order(n, shuffle=shuffle, gen=gen)


def _order(n: int, *, shuffle: bool, gen: torch.Generator) -> torch.Tensor:
    """An epoch's sample order: a fresh permutation from ``gen`` when shuffling, else as is."""
    return torch.randperm(n, generator=gen) if shuffle else torch.arange(n)


def _check_plan_matches_megatron(plan: Plan) -> None:
    """The plan's rank coordinates are Megatron's (its rank order): say so loudly if that ever changes."""
    rank = dist.get_rank()
    ours = plan.roles["actor"].coords(rank)
    theirs = {"tp": parallel_state.get_tensor_model_parallel_rank(), "cp": parallel_state.get_context_parallel_rank(),
              "dp": parallel_state.get_data_parallel_rank(), "pp": parallel_state.get_pipeline_model_parallel_rank()}
    if ours != theirs:
        raise RuntimeError(f"rank {rank}: the plan places it at {ours}, Megatron's parallel_state at {theirs}")
