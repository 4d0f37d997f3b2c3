"""Disaggregated placement: the rollout engines on ranks of their own, the trainer on the rest.

``actor_rollout_ref.rollout.placement=disaggregated`` with ``rollout.num_ranks`` = k under a launch of W ranks
(the plan, :mod:`hybridrl.config.plan`): ranks W − k … W − 1 run engines and nothing else, ranks 0 … W − k − 1
train. Before anything is built each rank takes its side (:func:`split_world`):

- a **trainer** rank sees a world of W − k (``WORLD_SIZE`` is rewritten before the process group starts), so
  Megatron's TP/PP/CP/DP span the trainer ranks only and every collective of the trainer stays among them;
- an **engine** rank never joins that world: :func:`serve` builds its engine (the leader of each rollout-TP group)
  and answers trainer rank 0 over the bridge (:mod:`hybridrl.distributed.bridge`) until told to stop.

On the trainer side :class:`RemoteEngines` is what :class:`~hybridrl.rollout.colocated.ColocatedEngines` is for a
colocated run — the same calls, the same split of a batch over the engines and the same per-prompt seeds, so the
samples (and, with an engine that honours per-sample seeds, the whole run) equal a colocated run's. Trainer rank 0
sends each call's prompts, receives every engine's samples and shares them with the other trainer ranks; weights
go as the actor's bucketed, versioned HF-named stream, each bucket broadcast once to all engine ranks. The engines
keep their memory throughout (no release/resume: nothing else runs on their devices).

In this synchronous mode (``async_training.enable=false``) a step still waits for its rollouts, and the engines
wait for the update; the asynchronous driver overlaps the two.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.batch import SampleMeta
from hybridrl.config.plan import Plan
from hybridrl.config.schema import RLConfig
from hybridrl.distributed import host_group
from hybridrl.distributed.bridge import Bridge
from hybridrl.interfaces import Generation, SamplingParams, WeightBucket
from hybridrl.rollout.colocated import EngineRouting, build_engine_factory, generate_share
from hybridrl.rollout.partial import Interrupt, generate_continued


def launch_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def split_world(plan: Plan) -> bool:
    """Take this rank's side of a disaggregated launch; True on an engine rank (which then runs :func:`serve`).
    On a trainer rank the process group to come spans the trainer ranks (``WORLD_SIZE`` := W − k)."""
    if plan.trainer_world_size == plan.world_size:
        return False
    if plan.is_engine_rank(launch_rank()):
        return True
    os.environ["WORLD_SIZE"] = str(plan.trainer_world_size)  # (a teacher rank never gets here: teacher_service)
    return False


def bridge_ranks(plan: Plan) -> list[int]:
    """The bridge's members as launch ranks: trainer rank 0, then every engine rank."""
    return [0, *range(plan.trainer_world_size, plan.trainer_world_size + plan.num_engine_ranks)]


class RemoteEngines(EngineRouting):
    """Trainer side: the engines of the engine ranks behind the colocated engines' calls."""

    def __init__(self, plan: Plan, *, pad_token_id: int, timeout_s: float) -> None:
        self.plan, self.pad_token_id, self.weight_version = plan, pad_token_id, 0
        self.rank = dist.get_rank()
        self.dp_rank = plan.dp_rank_of(self.rank)
        self.bridge = (Bridge(rank=0, launch_ranks=bridge_ranks(plan), timeout_s=timeout_s) if self.rank == 0
                       else None)
        self._leaders = [1 + e.leader - plan.trainer_world_size for e in plan.engines]  # bridge ranks
        self._tickets = 0
        self.engine_busy_s = 0.0  # the busiest engine's generating time, summed over collects (all ranks)
        self.waited_s = 0.0  # rank 0's time waiting for samples and for the engines to take weights

    @contextmanager
    def awake(self) -> Iterator[None]:
        """Nothing to resume or release: the engine ranks hold their memory throughout."""
        yield

    def generate_ids(self, contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
                     max_new_tokens: Sequence[int] | None = None) -> list[Generation]:
        """As :meth:`ColocatedEngines.generate_ids <hybridrl.rollout.colocated.ColocatedEngines.generate_ids>`:
        every trainer rank gets all the samples, in context order."""
        return self.collect(self.submit(contexts, params, seeds=seeds, max_new_tokens=max_new_tokens))

    def submit(self, contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
               max_new_tokens: Sequence[int] | None = None) -> int:
        """Queue a generation on the engines (they run their commands in order) and return its ticket for
        :meth:`collect`; the trainer goes on meanwhile."""
        self._tickets += 1
        if self.bridge is not None:
            self.bridge.broadcast_object(("generate", self._tickets, list(contexts), params, list(seeds),
                                          None if max_new_tokens is None else list(max_new_tokens)))
        return self._tickets

    def submit_episodes(self, contexts: Sequence[list[int]], metas: Sequence[SampleMeta], params: SamplingParams,
                        *, seed: int) -> int:
        """Queue a batch of multi-turn episodes, each played out on the engine rank that holds its prompt (its
        engine, tools and environment: :func:`hybridrl.rollout.multi_turn.play_share`); the ticket's parts are
        :class:`~hybridrl.rollout.multi_turn.Episodes`."""
        self._tickets += 1
        if self.bridge is not None:
            self.bridge.broadcast_object(("episodes", self._tickets, list(contexts), list(metas), params, seed))
        return self._tickets

    def collect(self, ticket: int) -> list[Generation]:
        """The samples of the generation ``ticket`` (waiting for them), on every trainer rank."""
        return [g for gens in self.collect_parts(ticket) for g in gens]

    def collect_parts(self, ticket: int) -> list[Any]:
        """What each engine made of ticket ``ticket`` (waiting for it), in engine order, on every trainer rank;
        the engines' busy seconds since the last collect are added to :attr:`engine_busy_s`."""
        out: list[Any] = [None]
        if self.bridge is not None:
            start = time.perf_counter()
            self.bridge.broadcast_object(("collect", ticket))
            parts = [self.bridge.recv_object(src=leader) for leader in self._leaders]
            self.waited_s += time.perf_counter() - start
            out = [([made for made, _ in parts], max(busy for _, busy in parts))]
        dist.broadcast_object_list(out, src=0, group=host_group.get())
        made, busy = out[0]
        self.engine_busy_s += busy
        return made

    def discard(self, ticket: int) -> None:
        """The generation ``ticket`` is not wanted (a dynamic-sampling round its step did not need): the engines
        drop it, unstarted, or let it finish and throw its samples away."""
        if self.bridge is not None:
            self.bridge.broadcast_object(("discard", ticket))

    def update_weights(self, stream: Iterable[WeightBucket], *, version: int) -> None:
        """Every trainer rank consumes the stream (it is made of collectives); rank 0 forwards each bucket."""
        start = time.perf_counter()
        if self.bridge is not None:  # the engines take it after the generations queued before it
            self.bridge.broadcast_object(("update_weights", version))
            self.waited_s += time.perf_counter() - start
        for bucket in stream:
            if self.bridge is not None:
                self.bridge.broadcast_bucket(bucket)
        if self.bridge is not None:
            self.bridge.broadcast_bucket(None)
        self.weight_version = version

    def shutdown(self) -> None:
        if self.bridge is not None:
            self.bridge.broadcast_object(("stop",))
            self.bridge.close()
            self.bridge = None


def serve(cfg: RLConfig, plan: Plan) -> None:
    """Engine side: build this rank's engine (the leader of its group does) and answer trainer rank 0's commands,
    in order — queue a generation of this engine's share of a batch (a worker thread runs them in order; the
    samples are kept under its ticket), send a ticket's samples once done (or drop them: ``discard``), take a
    weight stream in place — until it says stop. A weight update waits for the generations queued before it (each
    runs on the weights of the last update before it) or, with ``async_training.partial_rollout``, interrupts the
    running one, which continues on the new weights (:mod:`hybridrl.rollout.partial`)."""
    rank, r = launch_rank(), cfg.actor_rollout_ref.rollout
    placement = plan.engine_of(rank)
    torch.manual_seed(cfg.trainer.seed)
    engine = None
    if rank == placement.leader:
        print(f"[hybridrl] rank {rank}: {placement}, disaggregated: starting {r.name}", flush=True)
        engine = build_engine_factory(r.name, r.engine_kwargs, model_path=cfg.actor_rollout_ref.model.path,
                                      gpu_memory_utilization=r.gpu_memory_utilization)(
            device=torch.device(placement.devices[0]), tp_size=plan.rollout_tp)
    bridge = Bridge(rank=1 + rank - plan.trainer_world_size, launch_ranks=bridge_ranks(plan),
                    timeout_s=cfg.trainer.dist_timeout_s)
    # generations run on a worker thread, in submission order, so a collect is answered as soon as its ticket is
    # done even while a later batch generates (the command stream would otherwise queue it behind that batch)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridrl-generate")
    done: dict[int, Future[list[Generation]]] = {}  # by ticket, until collected
    dropped: list[Future[list[Generation]]] = []  # discarded while running: a weight update still waits for them
    busy = [0.0]  # seconds generating since the last collect
    a = cfg.async_training
    interrupt = Interrupt(engine) if engine is not None and a.enable and a.partial_rollout else None

    def generate_on(share: range, contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
                    max_new_tokens: Sequence[int] | None = None) -> list[Generation]:
        if interrupt is not None:
            return generate_continued(engine, share, contexts, params, seeds=seeds, max_new_tokens=max_new_tokens,
                                      interrupt=interrupt)
        return generate_share(engine, share, contexts, params, seeds=seeds, max_new_tokens=max_new_tokens)

    def local(contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
              max_new_tokens: Sequence[int] | None = None, images: Sequence[Any] | None = None) -> list[Generation]:
        if images is not None:  # validation refuses a vision-language model here (check_vlm)
            raise ValueError("engines on ranks of their own do not take images yet (rollout.placement=disaggregated)")
        return generate_on(range(len(contexts)), contexts, params, seeds=seeds, max_new_tokens=max_new_tokens)

    @contextmanager
    def working() -> Iterator[None]:
        start, held = time.perf_counter(), 0.0 if interrupt is None else interrupt.waited_s
        try:
            yield
        finally:  # a pause's wait is not work
            busy[0] += time.perf_counter() - start - (0.0 if interrupt is None else interrupt.waited_s - held)

    def generate(contexts: list[list[int]], params: SamplingParams, seeds: list[int],
                 caps: list[int] | None) -> list[Generation]:
        with working():
            return generate_on(plan.engine_prompts(placement.index, len(contexts)), contexts, params, seeds=seeds,
                               max_new_tokens=caps)

    actors: list[Any] = []  # the multi-turn episodes' tools and environment, built at the first episodes

    def episodes(contexts: list[list[int]], metas: list[Any], params: SamplingParams, seed: int) -> Any:
        from hybridrl.rollout.multi_turn import play_share

        if engine is None:
            return None
        if not actors:
            actors.append(_episode_actors(cfg))
        with working():
            return play_share(actors[0], plan.engine_prompts(placement.index, len(contexts)), contexts, metas,
                              params, seed=seed, generate=local)

    try:
        while True:
            command, *args = bridge.broadcast_object()
            if command in ("generate", "episodes"):  # kept until collected: the trainer may queue several
                ticket, *call = args
                done[ticket] = worker.submit(generate if command == "generate" else episodes, *call)
            elif command == "collect":
                made = done.pop(args[0]).result()
                if engine is not None:
                    bridge.send_object((made, busy[0]), dst=0)
                busy[0] = 0.0
            elif command == "discard":
                pending = done.pop(args[0])
                if not pending.cancel():
                    dropped.append(pending)
            elif command == "update_weights":
                if interrupt is None:  # after the generations queued before it: they keep their weights
                    for pending in [*dropped, *done.values()]:
                        pending.result()
                    dropped.clear()
                buckets = _buckets(bridge)
                if engine is not None:
                    with nullcontext() if interrupt is None else interrupt.paused():
                        engine.update_weights(buckets, version=args[0])
                for _ in buckets:  # a rank without an engine (or an engine that stopped early) drains it
                    pass
            elif command == "stop":
                return
            else:
                raise RuntimeError(f"rank {rank}: unknown bridge command {command!r}")
    finally:
        worker.shutdown(wait=True, cancel_futures=True)
        if engine is not None:
            engine.shutdown()
        bridge.close()


def _episode_actors(cfg: RLConfig) -> Any:
    """The multi-turn rollout's tools, environment and turn renderer on an engine rank (as a trainer builds them)."""
    from transformers import AutoTokenizer

    from hybridrl.rollout.episodes import episode_actors

    model = cfg.actor_rollout_ref.model
    return episode_actors(cfg, AutoTokenizer.from_pretrained(model.tokenizer_path or model.path))


def _buckets(bridge: Bridge) -> Iterator[WeightBucket]:
    while (bucket := bridge.broadcast_bucket()) is not None:
        yield bucket
