"""The contracts between the RL loop and its plugins.

Every plugin is a class with a nested kw-only ``Config`` dataclass (possibly empty) and is built by
the registry as ``cls(config, **ctx)``; the context each group receives is documented on its
protocol. Shapes: ``B`` samples (prompts × n), ``T`` response tokens (right-padded).
Class attributes (``needs_group``, ``needs_critic``) are read by the static config validation
before anything heavy is built, so they must not require instantiation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from hybridrl.batch import RolloutBatch

# One bucket of the weight stream: HF parameter names with full (TP-gathered) tensors.
WeightBucket = list[tuple[str, "torch.Tensor"]]


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 64
    n: int = 1  # samples per prompt
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class Generation:
    """One sampled response."""

    prompt_index: int  # which input prompt it answers
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" (EOS / stop token) or "length"
    weight_version: int


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses from token ids; holds its own copy of the policy weights.

    Built with ctx: ``model_path: str``, ``device: torch.device`` and ``tp_size: int`` (the engine's
    tensor-parallel size; the engine spans ``tp_size`` devices starting at ``device``); an engine takes
    ``**ctx`` so that later context keys do not break it.
    """

    Config: ClassVar[type]
    supports_tensor_parallel: ClassVar[bool]  # False: validation rejects rollout.tensor_model_parallel_size > 1

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *,
                 seeds: Sequence[int] | None = None) -> list[Generation]:
        """``params.n`` samples per prompt, prompt-major (all of prompt 0's, then prompt 1's, ...).

        ``seeds[i]`` fixes prompt ``i``'s samples: sample ``j`` draws from a random stream determined by
        ``(seeds[i], j)`` alone, so a prompt's samples do not depend on the other prompts of the call or
        on which engine generates it (the same rollouts at every parallel layout). ``None``: the
        engine's own randomness. An engine that cannot honour per-sample seeds says so in its docstring.
        """

    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """Copy new weights into the engine's existing parameter storage (in place)."""

    def release_memory(self) -> None:
        """Give back KV cache (and weights where configured) before the train phase."""

    def resume_memory(self) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True, kw_only=True)
class RewardOutput:
    scores_B: torch.Tensor  # [B] sequence-level score, placed on the last response token by the loop
    # [B] bool: the sample's answer is right (accuracy metrics); None: the reward has no notion of
    # correctness, and accuracy counts score > 0
    correct_B: torch.Tensor | None = None
    info: dict[str, list[Any]] = field(default_factory=dict)  # other per-sample extras, e.g. {"has_answer": [...]}


@runtime_checkable
class RewardManager(Protocol):
    """Scores a batch of decoded responses. Built with ctx: ``tokenizer`` (the policy's) and ``device`` (this
    rank's: where a reward model runs); a reward takes ``**ctx`` so that later context keys do not break it.

    A reward that can tell a right answer from a wrong one also returns ``correct_B``. An exception with a
    ``sample_index`` attribute lets the runner name the sample (:mod:`hybridrl.rewards.execution`). Optional
    class flag ``overlaps_compute: ClassVar[bool]`` (absent: False): True lets the trainer score while the
    log-prob passes run — only for rewards that use neither the GPU nor ``torch.distributed``.
    """

    Config: ClassVar[type]

    def __call__(self, batch: RolloutBatch) -> RewardOutput: ...


@runtime_checkable
class AdvantageEstimator(Protocol):
    """Turns token-level rewards (and values) into advantages and returns. Built with no ctx.

    Every estimator class declares both flags below (the registry rejects one that does not).
    """

    Config: ClassVar[type]
    needs_group: ClassVar[bool]  # compares samples of one prompt: requires rollout.n >= 2
    needs_critic: ClassVar[bool]  # consumes values: requires a critic (value model)

    def __call__(
        self,
        *,
        token_rewards_BT: torch.Tensor,
        response_mask_BT: torch.Tensor,
        group_index_B: torch.Tensor,
        values_BT: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(advantages_BT, returns_BT)``, zero outside the response mask."""


@runtime_checkable
class PolicyLoss(Protocol):
    """The actor's surrogate objective. Built with no ctx."""

    Config: ClassVar[type]

    def __call__(
        self,
        *,
        logprobs_BT: torch.Tensor,
        old_logprobs_BT: torch.Tensor,
        advantages_BT: torch.Tensor,
        response_mask_BT: torch.Tensor,
        loss_agg_mode: str,
        global_normalizer: float | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Return ``(loss, metrics)``; metrics include ``pg_loss``, ``clipfrac`` and ``ppo_kl``.

        ``global_normalizer`` replaces the batch's own denominator of ``loss_agg_mode`` (see
        ``hybridrl.algorithms.loss_agg``), so micro-batch losses add up to the mini-batch loss.
        """
