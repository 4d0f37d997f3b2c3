"""``RolloutBatch``: the one typed object that flows through the RL loop.

Generation fills the prompt/response tensors; later stages fill the optional fields (reward →
``token_level_scores``/``token_level_rewards``, actor → ``old_logprobs``, ref → ``ref_logprobs``,
teacher → ``teacher_logprobs``, critic → ``values``, advantage estimator → ``advantages``/``returns``).

Shapes: ``B`` samples (prompts × n), ``P`` prompt tokens (**left**-padded), ``T`` response tokens
(**right**-padded). So ``cat([prompt, response])`` is one contiguous run of real tokens per row.
Padded positions hold ``pad_token_id`` in id tensors, 0 in masks and 0.0 in float tensors; always
read them through the masks. Two masks cover the response part:

- ``response_mask``: its real tokens (EOS included) — what the model attends to, and the response's length;
- ``loss_mask``: the tokens the policy sampled and is trained on (a subset). Every loss, normaliser, advantage,
  entropy, KL, value and rollout-vs-actor metric reads it; the sequence score sits on its last token. Tokens the
  policy did not sample (a tool's output, an environment's message, template separators in a multi-turn
  response) are in ``response_mask`` and not in ``loss_mask``.

In a single-turn batch the two are equal; a batch built without ``loss_mask`` gets a copy of ``response_mask``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from hybridrl.vlm.inputs import ImageInputs

Index = slice | Sequence[int] | torch.Tensor  # slice, list of ints, 1-D long or bool tensor


@dataclass(slots=True, kw_only=True, frozen=True)
class SampleMeta:
    """Non-tensor facts about one sample, carried from the dataset to the reward manager."""

    ground_truth: str | None = None  # the reference answer of a verifiable task
    data_source: str = ""  # dataset name, for per-source metrics
    # "stop" (EOS / stop token) or "length"; a multi-turn episode also "vision_token" (hybridrl.rollout.episodes); ""
    # before generation
    finish_reason: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)  # other dataset columns, untouched
    # the chat messages the prompt was rendered from (None: a plain-text prompt); a multi-turn rollout renders
    # its turns after them
    messages: list[dict[str, Any]] | None = None
    # Σ of the sample's environment rewards (a multi-turn rollout's environment; None: none): the reward runner
    # adds it to reward.name's score
    env_reward: float | None = None
    env_error: str | None = None  # the sample's environment failed (reward.on_error=zero: it scores 0.0)
    # the sample's images in sequence order (a vision-language model; hybridrl.vlm.inputs.ImageInputs): the prompt's,
    # then (a multi-turn episode) each tool result's; None: text only. The engine generates with them and the
    # actor/ref feed them to the vision tower
    images: ImageInputs | None = None


@dataclass(slots=True, kw_only=True)
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] 1 on prompt tokens
    response_ids: torch.Tensor  # [B, T] long, right-padded
    response_mask: torch.Tensor  # [B, T] 1 on real response tokens (attention, lengths)
    rollout_logprobs: torch.Tensor  # [B, T] float, log-prob of each token under the sampling engine
    weight_version: torch.Tensor  # [B] long, policy version that generated the sample
    group_index: torch.Tensor  # [B] long, which prompt the sample answers (GRPO groups)
    meta: list[SampleMeta]  # [B]
    pad_token_id: int  # fill value of padded id positions
    # [B, T] 1 on the tokens sampled and trained on, a subset of response_mask; not given: response_mask's copy
    loss_mask: torch.Tensor = None  # type: ignore[assignment]  # always a tensor after __post_init__

    token_level_scores: torch.Tensor | None = None  # [B, T] raw reward (score on the last token)
    token_level_rewards: torch.Tensor | None = None  # [B, T] scores after KL penalty etc.
    old_logprobs: torch.Tensor | None = None  # [B, T] actor log-probs before the update
    ref_logprobs: torch.Tensor | None = None  # [B, T] reference-policy log-probs
    teacher_logprobs: torch.Tensor | None = None  # [B, T] the distillation teacher's (actor_rollout_ref.teacher)
    values: torch.Tensor | None = None  # [B, T] critic values
    advantages: torch.Tensor | None = None  # [B, T]
    returns: torch.Tensor | None = None  # [B, T]
    # an MoE model's routing (router replay, actor.router_replay.mode): the experts each position was routed to,
    # [B, P, L, k] and [B, T, L, k] int16 (L MoE layers, top-k), -1 where none was recorded (padding; a response's
    # last token, which the engine never ran)
    prompt_routed_experts: torch.Tensor | None = None
    response_routed_experts: torch.Tensor | None = None
    # the teacher's K most likely tokens at each response position and their log-probs, [B, T, K] long / float
    # (a top-k distillation loss: actor_rollout_ref.teacher.loss); padded as the response fields
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None

    PROMPT_FIELDS: ClassVar[tuple[str, ...]] = ("prompt_ids", "prompt_mask")
    RESPONSE_FIELDS: ClassVar[tuple[str, ...]] = (
        "response_ids", "response_mask", "loss_mask", "rollout_logprobs", "token_level_scores",
        "token_level_rewards", "old_logprobs", "ref_logprobs", "teacher_logprobs", "values", "advantages", "returns",
    )
    SAMPLE_FIELDS: ClassVar[tuple[str, ...]] = ("weight_version", "group_index")
    # [B, P, ...] / [B, T, ...]: padded as the prompt / response fields, with -1
    ROUTING_FIELDS: ClassVar[tuple[str, ...]] = ("prompt_routed_experts", "response_routed_experts")
    TOPK_FIELDS: ClassVar[tuple[str, ...]] = ("teacher_topk_ids", "teacher_topk_logprobs")  # [B, T, K]
    _FIELDS: ClassVar[tuple[str, ...]] = (*PROMPT_FIELDS, *RESPONSE_FIELDS, *SAMPLE_FIELDS, *ROUTING_FIELDS,
                                          *TOPK_FIELDS)

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.response_mask.clone()
        b, p = self.prompt_ids.shape
        t = self.response_ids.shape[1]
        for name, shape in self._expected_shapes(b, p, t).items():
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(
                    f"RolloutBatch.{name} has shape {tuple(value.shape)}, expected {shape} "
                    f"(B={b} from prompt_ids, P={p}, T={t} from response_ids)"
                )
        for name, length in zip(self.ROUTING_FIELDS, (p, t), strict=True):
            value = getattr(self, name)
            if value is not None and (value.dim() != 4 or tuple(value.shape[:2]) != (b, length)):
                raise ValueError(f"RolloutBatch.{name} has shape {tuple(value.shape)}, expected ({b}, {length}, "
                                 f"MoE layers, top-k)")
        topk = [v for n in self.TOPK_FIELDS if (v := getattr(self, n)) is not None]
        if topk and (len(topk) == 1 or any(v.dim() != 3 or tuple(v.shape[:2]) != (b, t) for v in topk)
                     or topk[0].shape != topk[1].shape):
            raise ValueError(f"RolloutBatch.teacher_topk_ids / teacher_topk_logprobs: both or neither, each of shape "
                             f"({b}, {t}, K), got {[tuple(v.shape) for v in topk]}")
        if len(self.meta) != b:
            raise ValueError(f"RolloutBatch.meta has {len(self.meta)} entries, expected B={b}")

    @staticmethod
    def _expected_shapes(b: int, p: int, t: int) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {n: (b, p) for n in RolloutBatch.PROMPT_FIELDS}
        shapes.update({n: (b, t) for n in RolloutBatch.RESPONSE_FIELDS})
        shapes.update({n: (b,) for n in RolloutBatch.SAMPLE_FIELDS})
        return shapes

    # ---- size and selection ----
    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def index(self, idx: Index) -> RolloutBatch:
        """The samples at ``idx`` (slice, list of ints, 1-D long or bool tensor), in that order."""
        if isinstance(idx, int):
            raise TypeError(f"RolloutBatch.index selects a batch; pass [{idx}] or slice({idx}, {idx + 1}), not {idx}")
        if isinstance(idx, slice):
            positions = list(range(len(self)))[idx]
        else:
            if not isinstance(idx, torch.Tensor):
                idx = torch.tensor(list(idx), dtype=None if len(idx) else torch.long)
            if idx.dtype == torch.bool:
                idx = idx.nonzero().squeeze(-1)
            positions = idx.tolist()
        tensors: dict[str, Any] = {n: v[idx] for n, v in self._tensors().items() if v is not None}
        return dataclasses.replace(self, **tensors, meta=[self.meta[i] for i in positions])

    def split(self, size: int) -> list[RolloutBatch]:
        """Consecutive chunks of ``size`` samples; the last one is smaller when B % size != 0."""
        if size < 1:
            raise ValueError(f"split size must be >= 1, got {size}")
        return [self.index(slice(start, start + size)) for start in range(0, len(self), size)]

    @classmethod
    def cat(cls, batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Concatenate along B, re-padding prompts (left) and responses (right) to the longest."""
        if not batches:
            raise ValueError("RolloutBatch.cat needs at least one batch")
        first = batches[0]
        if any(b.pad_token_id != first.pad_token_id for b in batches):
            raise ValueError(f"cannot cat batches with different pad_token_id: "
                             f"{sorted({b.pad_token_id for b in batches})}")
        p = max(b.prompt_ids.shape[1] for b in batches)
        t = max(b.response_ids.shape[1] for b in batches)
        tensors: dict[str, torch.Tensor | None] = {}
        for name in cls._FIELDS:
            values = [getattr(b, name) for b in batches]
            present = [v is not None for v in values]
            if not any(present):
                tensors[name] = None
                continue
            if not all(present):
                raise ValueError(f"cannot cat batches where only some have RolloutBatch.{name} "
                                 f"(present in batches {[i for i, ok in enumerate(present) if ok]})")
            fill = first.pad_token_id if name.endswith("_ids") else -1 if name in cls.ROUTING_FIELDS else 0
            if name in cls.PROMPT_FIELDS or name == "prompt_routed_experts":
                values = [_pad(v, p, fill, left=True) for v in values]
            elif name in cls.RESPONSE_FIELDS or name in cls.TOPK_FIELDS or name == "response_routed_experts":
                values = [_pad(v, t, fill, left=False) for v in values]
            tensors[name] = torch.cat(values)
        meta = [m for b in batches for m in b.meta]
        return cls(**tensors, meta=meta, pad_token_id=first.pad_token_id)  # type: ignore[arg-type]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """This batch with every tensor on ``device`` (``self`` when they already are there)."""
        device = torch.device(device)
        tensors = {n: v for n, v in self._tensors().items() if v is not None}
        if all(v.device == device for v in tensors.values()):
            return self
        return dataclasses.replace(self, **{n: v.to(device) for n, v in tensors.items()})

    def _tensors(self) -> dict[str, torch.Tensor | None]:
        return {n: getattr(self, n) for n in self._FIELDS}


def _pad(x: torch.Tensor, length: int, fill: float | int, *, left: bool) -> torch.Tensor:
    """Pad dim 1 of ``x`` [B, L, ...] to ``length`` with ``fill`` on the left or the right."""
    extra = length - x.shape[1]
    if extra == 0:
        return x
    pad = torch.full((x.shape[0], extra, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], dim=1)
