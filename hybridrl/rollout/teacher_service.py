"""The distillation teacher on engine ranks of its own (``actor_rollout_ref.teacher.inference.name`` set).

verl serves a distillation teacher with an inference engine on GPUs of its own (``distillation.nnodes`` ×
``distillation.n_gpus_per_node``): the teacher is often several times the student, so it neither fits beside the
trainer nor should it pay Megatron's training layout. Here the last ``inference.num_ranks`` ranks of the launch
(:class:`~hybridrl.config.plan.Plan`: ``teacher_engines``) each belong to one engine of
``inference.tensor_model_parallel_size`` ranks, whose first rank builds it with the teacher's checkpoint; they
never join the trainer's world.

Each step, after the rollout, :class:`RemoteTeacher` scores the step's samples:

1. every trainer rank turns its DP share of the batch into token sequences (prompt ‖ response, padding dropped)
   and the position of the first response token; trainer rank 0 gathers one copy per DP rank;
2. rank 0 sends them over a bridge (:mod:`hybridrl.distributed.bridge`, its own key prefix) to the teacher ranks;
   each engine scores its contiguous share (the engine's optional ``score``:
   :class:`~hybridrl.interfaces.TokenScores`, teacher-forced log-probs under softmax(logits / T) and, for a top-k
   distillation loss, the top-k tokens at each response position);
3. rank 0 sends each trainer rank its DP rank's scores, which fill ``batch.teacher_logprobs`` (and
   ``teacher_topk_{ids,logprobs}``) exactly where the Megatron teacher's pass would (zeros outside the response).

The teacher's weights never change, so nothing is synced. Its memory is the engine's, on its own devices.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.batch import RolloutBatch
from hybridrl.config.layout import shares
from hybridrl.config.plan import Plan
from hybridrl.config.schema import RLConfig
from hybridrl.distributed import host_group
from hybridrl.distributed.bridge import Bridge
from hybridrl.interfaces import TokenScores

PREFIX = "hybridrl/teacher-bridge"


def bridge_ranks(plan: Plan) -> list[int]:
    """The teacher bridge's members as launch ranks: trainer rank 0, then every teacher rank."""
    return [0, *range(plan.world_size - plan.num_teacher_ranks, plan.world_size)]


def sequences(batch: RolloutBatch) -> tuple[list[list[int]], list[int]]:
    """Each row as one token sequence (its prompt's tokens, then its response's, padding dropped) and the position
    of its first response token: what a teacher engine scores."""
    seqs, starts = [], []
    for b in range(len(batch)):
        prompt = batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist()
        n = int(batch.response_mask[b].sum())
        seqs.append(prompt + batch.response_ids[b, :n].tolist())
        starts.append(len(prompt))
    return seqs, starts


def fill(batch: RolloutBatch, scores: list[TokenScores], *, topk: int) -> None:
    """Write a teacher engine's scores of ``batch``'s rows into its teacher fields (zeros outside the response)."""
    B, T = batch.response_ids.shape
    lp_BT = torch.zeros(B, T)
    ids_BTK, topk_BTK = (torch.zeros(B, T, topk, dtype=torch.long), torch.zeros(B, T, topk)) if topk else (None, None)
    for b, s in enumerate(scores):
        n = s.logprobs.shape[0]
        lp_BT[b, :n] = s.logprobs
        if ids_BTK is not None and topk_BTK is not None:
            assert s.topk_ids is not None and s.topk_logprobs is not None, "the engine returned no top-k"
            ids_BTK[b, :n], topk_BTK[b, :n] = s.topk_ids, s.topk_logprobs
    batch.teacher_logprobs = lp_BT
    if ids_BTK is not None:
        batch.teacher_topk_ids, batch.teacher_topk_logprobs = ids_BTK, topk_BTK


class RemoteTeacher:
    """Trainer side: the teacher engines behind ``ActorRolloutRef.compute_teacher_log_probs``."""

    def __init__(self, plan: Plan, *, timeout_s: float) -> None:
        self.plan, self.rank = plan, dist.get_rank()
        self.bridge = (Bridge(rank=0, launch_ranks=bridge_ranks(plan), timeout_s=timeout_s, prefix=PREFIX)
                       if self.rank == 0 else None)
        self._leaders = [1 + e.leader - (plan.world_size - plan.num_teacher_ranks) for e in plan.teacher_engines]
        self.waited_s = 0.0  # rank 0's time waiting for the teacher's scores

    def score(self, batch: RolloutBatch, *, topk: int, temperature: float) -> None:
        """Fill ``batch``'s teacher fields (every trainer rank, its own DP share)."""
        group, dp_rank = host_group.get(), self.plan.dp_rank_of(self.rank)
        mine = (dp_rank, *sequences(batch))
        world = dist.get_world_size()
        gathered: list[Any] = [None] * world if self.rank == 0 else []
        dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0, group=group)
        out: list[Any] = [None]
        if self.rank == 0:
            firsts = {}  # one copy of each DP rank's rows (its TP/PP/CP ranks hold the same)
            for dp, seqs, starts in gathered:
                firsts.setdefault(dp, (seqs, starts))
            order = sorted(firsts)
            seqs = [s for dp in order for s in firsts[dp][0]]
            starts = [s for dp in order for s in firsts[dp][1]]
            scores = self._remote(seqs, starts, topk=topk, temperature=temperature)
            by_dp, at = {}, 0
            for dp in order:
                n = len(firsts[dp][0])
                by_dp[dp], at = scores[at:at + n], at + n
            per_rank = [by_dp[dp] for dp, _, _ in gathered]
        else:
            per_rank = None
        dist.scatter_object_list(out, per_rank, src=0, group=group)
        fill(batch, out[0], topk=topk)

    def _remote(self, seqs: list[list[int]], starts: list[int], *, topk: int,
                temperature: float) -> list[TokenScores]:
        assert self.bridge is not None
        start = time.perf_counter()
        self.bridge.broadcast_object(("score", seqs, starts, topk, temperature))
        parts = [self.bridge.recv_object(src=leader) for leader in self._leaders]
        self.waited_s += time.perf_counter() - start
        return [s for part in parts for s in part]

    def shutdown(self) -> None:
        if self.bridge is not None:
            self.bridge.broadcast_object(("stop",))
            self.bridge.close()
            self.bridge = None


def serve(cfg: RLConfig, plan: Plan, rank: int) -> None:
    """Teacher side: the leader of this rank's engine builds it with the teacher's checkpoint; every teacher rank
    answers trainer rank 0's commands until told to stop — ``score``: this engine's contiguous share of the
    sequences, sent back by the leader."""
    from hybridrl.rollout.colocated import build_engine_factory

    t = cfg.actor_rollout_ref.teacher
    placement = plan.teacher_engine_of(rank)
    engine = None
    if rank == placement.leader:
        assert t.inference.name is not None and t.model.path is not None
        print(f"[hybridrl] rank {rank}: teacher {placement}: starting {t.inference.name} on {t.model.path}",
              flush=True)
        engine = build_engine_factory(t.inference.name, t.inference.engine_kwargs, model_path=t.model.path,
                                      gpu_memory_utilization=t.inference.gpu_memory_utilization)(
            device=torch.device(placement.devices[0]), tp_size=t.inference.tensor_model_parallel_size)
    first = plan.world_size - plan.num_teacher_ranks
    bridge = Bridge(rank=1 + rank - first, launch_ranks=bridge_ranks(plan), timeout_s=cfg.trainer.dist_timeout_s,
                    prefix=PREFIX)
    try:
        while True:
            command, *args = bridge.broadcast_object()
            if command == "score":
                seqs, starts, topk, temperature = args
                if engine is not None:
                    share = shares(len(seqs), len(plan.teacher_engines))[placement.index]
                    scored = engine.score([seqs[i] for i in share], starts=[starts[i] for i in share], topk=topk,
                                          temperature=temperature)
                    bridge.send_object(scored, dst=0)
            elif command == "stop":
                return
            else:
                raise RuntimeError(f"rank {rank}: unknown teacher bridge command {command!r}")
    finally:
        if engine is not None:
            engine.shutdown()
        bridge.close()
