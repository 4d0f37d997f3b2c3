"""Colocated engines: the rollout engines of a run placed as the plan says, and their samples routed to the trainers.

Every rank runs this same code. The plan (:mod:`hybridrl.config.plan`) puts one engine on each group of
``rollout.tensor_model_parallel_size`` consecutive ranks; the group's first rank builds it on the
group's first device (it spans the group's devices). A batch of prompts — the same on every rank — is
split over the engines in contiguous shares; each engine generates its share; the samples are
gathered (a gloo group: plain Python objects, no device memory) and every rank keeps its DP rank's
contiguous share, so model-parallel peers hold identical batches.

Sampling is seeded per prompt from ``(seed, position in the batch)``: with an engine that honours
per-sample seeds (``hf``), the samples of a prompt do not depend on how the batch is split over
engines, i.e. on the parallel layout.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch.distributed as dist

from hybridrl.batch import RolloutBatch
from hybridrl.config.plan import Plan
from hybridrl.data.collate import PromptBatch
from hybridrl.distributed import host_group
from hybridrl.interfaces import Generation, RolloutEngine, SamplingParams, WeightBucket
from hybridrl.rollout.batching import rollout_batch_from_generations
from hybridrl.seeds import prompt_seed
from hybridrl.vlm.inputs import ImageInputs

# builds this rank's engine: (device, tp_size) -> engine
EngineFactory = Callable[..., RolloutEngine]


class EngineRouting:
    """What both placements share: a batch of prompts in, this rank's DP share of the samples out."""

    plan: Plan
    dp_rank: int
    pad_token_id: int
    weight_version: int

    def generate(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> RolloutBatch:
        """``params.n`` samples of every prompt of ``prompts`` (the whole batch, the same on every rank);
        returns this rank's DP share of them."""
        images = [m.images for m in prompts.meta]
        with self.awake():
            gens = self.generate_ids(prompts.token_lists(), params,
                                     seeds=[prompt_seed(seed, i) for i in range(len(prompts))],
                                     **({"images": images} if any(x is not None for x in images) else {}))
        return self.dp_share(prompts, gens)

    def awake(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def generate_ids(self, contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
                     max_new_tokens: Sequence[int] | None = None,
                     images: Sequence[ImageInputs | None] | None = None) -> list[Generation]:
        raise NotImplementedError

    def update_weights(self, stream: Iterable[WeightBucket], *, version: int) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def dp_share(self, prompts: PromptBatch, gens: Sequence[Generation]) -> RolloutBatch:
        """This rank's DP share of the samples ``gens`` of the whole batch ``prompts`` (every rank holds all)."""
        mine = self.dp_prompts(len(prompts))
        kept = [dataclasses.replace(g, prompt_index=g.prompt_index - mine.start)
                for g in gens if g.prompt_index in mine]
        return rollout_batch_from_generations(prompts.select(mine), kept, pad_token_id=self.pad_token_id)

    def dp_prompts(self, num_prompts: int) -> range:
        """The positions of the prompts of a batch of ``num_prompts`` whose samples this rank keeps."""
        return self.plan.batch.dp_prompts(self.dp_rank, num_prompts)


class ColocatedEngines(EngineRouting):
    def __init__(self, plan: Plan, *, build_engine: EngineFactory, pad_token_id: int) -> None:
        self.plan = plan
        self.rank = dist.get_rank()
        self.placement = plan.engine_of(self.rank)
        self.dp_rank = plan.dp_rank_of(self.rank)
        self.pad_token_id = pad_token_id
        self.weight_version = 0
        self.engine: RolloutEngine | None = None
        self._awake = 0  # nesting depth of awake()
        if self.rank == self.placement.leader:
            self.engine = build_engine(device=self.placement.devices[0], tp_size=plan.rollout_tp)

    @contextmanager
    def awake(self) -> Iterator[None]:
        """The engines hold their memory inside (resumed once, released at the end: a multi-turn rollout keeps
        its KV/prefix cache over its turns); calls nest."""
        self._awake += 1
        if self._awake == 1 and self.engine is not None:
            self.engine.resume_memory()
        try:
            yield
        finally:
            self._awake -= 1
            if self._awake == 0 and self.engine is not None:
                self.engine.release_memory()

    def generate_ids(self, contexts: Sequence[list[int]], params: SamplingParams, *, seeds: Sequence[int],
                     max_new_tokens: Sequence[int] | None = None,
                     images: Sequence[ImageInputs | None] | None = None) -> list[Generation]:
        """``params.n`` samples of each token-id context (the same list on every rank; ``seeds[i]`` fixes context
        ``i``'s; ``max_new_tokens[i]`` caps it; ``images[i]`` are its images), split over the engines in contiguous
        shares; every rank gets all of them, in context order (``prompt_index``: the context's position). Call
        inside :meth:`awake`."""
        share = self.plan.engine_prompts(self.placement.index, len(contexts))
        made = generate_share(self.engine, share, contexts, params, seeds=seeds, max_new_tokens=max_new_tokens,
                              images=images)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, made, group=host_group.get())  # host objects: over gloo
        return [g for part in everyone for g in part]  # engines in rank order: context order, then sample order

    def update_weights(self, stream: Iterable[WeightBucket], *, version: int) -> None:
        """Feed the weight stream to this rank's engine (if any) in place; every rank consumes the stream,
        which is made of collectives."""
        it = iter(stream)
        if self.engine is not None:
            self.engine.update_weights(it, version=version)
        for _ in it:
            pass
        self.weight_version = version

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def build_engine_factory(name: str, engine_kwargs: dict[str, Any], *, model_path: str,
                         gpu_memory_utilization: float) -> EngineFactory:
    """``(device=, tp_size=) -> engine``: the ``rollout_engines`` plugin ``name`` with its config."""
    from hybridrl.registry import Registry

    return lambda **where: Registry("rollout_engines").build(
        name, engine_kwargs, key="actor_rollout_ref.rollout.engine_kwargs", model_path=model_path,
        gpu_memory_utilization=gpu_memory_utilization, **where)


def generate_share(engine: RolloutEngine | None, share: range, contexts: Sequence[list[int]],
                   params: SamplingParams, *, seeds: Sequence[int], max_new_tokens: Sequence[int] | None,
                   images: Sequence[ImageInputs | None] | None = None) -> list[Generation]:
    """``engine``'s samples of the contexts at positions ``share`` (``prompt_index``: the position in
    ``contexts``); [] on a rank without an engine."""
    if engine is None or not len(share):
        return []
    caps = None if max_new_tokens is None else [max_new_tokens[i] for i in share]
    # RolloutEngine.generate's optional per-prompt caps (an engine written before them does without)
    takes_caps = "max_new_tokens" in inspect.signature(engine.generate).parameters
    kw: dict[str, Any] = {} if caps is None or not takes_caps else {"max_new_tokens": caps}
    if images is not None and any(images[i] is not None for i in share):
        if not getattr(engine, "supports_images", False):  # validation refuses this before anything is built
            raise ValueError(f"rollout engine {type(engine).__name__} does not take images")
        kw["images"] = [images[i] for i in share]
    gens = engine.generate([contexts[i] for i in share], params, seeds=[seeds[i] for i in share], **kw)
    if caps is not None and not kw:  # an engine without per-prompt caps: cut its samples here
        gens = [_cut(g, caps[g.prompt_index]) for g in gens]
    return [dataclasses.replace(g, prompt_index=share.start + g.prompt_index) for g in gens]


def _cut(g: Generation, cap: int) -> Generation:
    if len(g.token_ids) <= cap:
        return g
    return dataclasses.replace(g, token_ids=g.token_ids[:cap], logprobs=g.logprobs[:cap], finish_reason="length",
                               loss_mask=None if g.loss_mask is None else g.loss_mask[:cap])
