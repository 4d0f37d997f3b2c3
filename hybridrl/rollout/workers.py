"""The engines a rollout owns, and the two things it needs of the trainer: room to generate and the new weights.

Every rank builds the run's engines as the plan places them (:func:`build_engines`: colocated, one per rollout-TP
group, or on ranks of their own) and wraps them with the trainer side in :class:`EngineWorkers`, which the rollout
kinds (:mod:`hybridrl.rollout.build`) hold:

- the generate phase: the trainer moves its state to host memory as its ``*_offload`` keys say
  (:meth:`TrainerSide.offload_for_generation`), then the engines hold their memory over all the calls inside;
- the weight sync: the trainer's bucketed, HF-named weight stream (:meth:`TrainerSide.weights_for_engines`) is
  copied into every engine in place, with the next weight version.

The trainer (:class:`~hybridrl.hybrid.ActorRolloutRef`) knows nothing of the engines; nothing here imports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from hybridrl.batch import RolloutBatch
from hybridrl.data.collate import PromptBatch
from hybridrl.interfaces import SamplingParams, WeightBucket
from hybridrl.rollout.colocated import ColocatedEngines, EngineRouting, build_engine_factory

if TYPE_CHECKING:
    from hybridrl.config.plan import Plan
    from hybridrl.config.schema import RLConfig


class TrainerSide(Protocol):
    """What the engines need of the trainer."""

    def offload_for_generation(self) -> None:
        """Before the engines take their memory: the trainer's state waits in host memory as configured."""

    def weights_for_engines(self, *, bucket_bytes: int) -> Iterable[WeightBucket]:
        """The actor's weights as HF-named buckets of about ``bucket_bytes`` (a stream of collectives: every rank
        consumes it whole)."""


class EngineWorkers:
    """The run's engines (either placement) with the trainer's memory phases and weight stream."""

    def __init__(self, engines: EngineRouting, *, trainer: TrainerSide, bucket_megabytes: int) -> None:
        self.engines, self.trainer, self.bucket_bytes = engines, trainer, bucket_megabytes << 20

    @property
    def weight_version(self) -> int:
        return self.engines.weight_version

    def generate(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> RolloutBatch:
        """Samples of the whole batch ``prompts``; this rank gets its DP rank's share."""
        with self.generating() as engines:
            return engines.generate(prompts, params, seed=seed)

    @contextmanager
    def generating(self) -> Iterator[EngineRouting]:
        """The generate phase (over all the calls inside: a multi-turn rollout's turns)."""
        self.trainer.offload_for_generation()
        with self.engines.awake():
            yield self.engines

    def sync_weights(self, *, version: int | None = None) -> float:
        """Stream the actor's weights into the engines in place, as ``version`` (default: the next one); the MB
        streamed."""
        sent = 0

        def counted(stream: Iterable[WeightBucket]) -> Iterator[WeightBucket]:
            nonlocal sent
            for bucket in stream:
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
                yield bucket

        self.engines.update_weights(counted(self.trainer.weights_for_engines(bucket_bytes=self.bucket_bytes)),
                                    version=self.weight_version + 1 if version is None else version)
        return sent / 2**20

    def shutdown(self) -> None:
        self.engines.shutdown()


def build_engines(cfg: RLConfig, plan: Plan, *, pad_token_id: int) -> EngineRouting:
    """This rank's view of the run's engines, placed as ``plan`` says (``rollout.placement``)."""
    r, model_path = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model.path
    if plan.num_engine_ranks:  # the engines run on their own ranks
        from hybridrl.rollout.disaggregated import RemoteEngines

        return RemoteEngines(plan, pad_token_id=pad_token_id, timeout_s=cfg.trainer.dist_timeout_s)
    return ColocatedEngines(plan, pad_token_id=pad_token_id, build_engine=build_engine_factory(
        r.name, r.engine_kwargs, model_path=model_path, gpu_memory_utilization=r.gpu_memory_utilization))
