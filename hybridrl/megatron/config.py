"""The settings of the Megatron side, owned here and composed into the run's config tree by
:mod:`hybridrl.config.schema`: a role's Megatron layout and precision (``MegatronConfig``; the ref's and the
critic's follow the actor's), the optimizer (``OptimConfig``), Megatron's rules for a layout
(:func:`layout_problems`, which static validation collects and ``ParallelConfig`` raises) and how one pass cuts a
DP rank's samples into micro-batches (:class:`MicroBatching`, which the plan computes and the runner reads).

Imports neither torch nor Megatron: static validation reads it before anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")  # Megatron's OptimizerConfig.optimizer
LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine")  # Megatron's OptimizerParamScheduler


@dataclass(kw_only=True, slots=True)
class MegatronConfig:
    """Megatron-core parallel layout of the actor (the ref shares it)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # virtual pipeline stages per rank (interleaved 1F1B); null = plain 1F1B
    virtual_pipeline_model_parallel_size: int | None = None
    # verl and Megatron both call this context_parallel_size
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    # EP (MoE models): ranks that split each MoE layer's experts (verl's and Megatron's name); Megatron's expert
    # grid takes EP × ETP of the TP×CP×DP ranks of a pipeline stage
    expert_model_parallel_size: int = 1
    # ETP: ranks that split each expert's matrices; null: the model's TP (Megatron's default). ETP=1 with TP=2 and
    # EP=8 (verl's MoE scripts) keeps every expert whole and lets EP span the TP ranks
    expert_tensor_parallel_size: int | None = None
    use_distributed_optimizer: bool = False
    # parameters and compute, one of transformer_overrides.DTYPES (float32, or bfloat16 / float16:
    # fp32 main weights and grads in the optimizer; float16 adds dynamic loss scaling); the ref runs in the actor's
    dtype: str = "float32"
    # memory phases (colocated rollout): move this state to host memory while the engine generates
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    # the fused log-prob + entropy kernels of hybridrl/ops (C++ on CPU, Triton on CUDA; verl's name for the
    # switch): null = use them when they build (else the plain-PyTorch path, one warning); true = required
    use_fused_kernels: bool | None = None
    # with the fused kernels: the policy's model returns hidden states and its head multiplies them by the LM-head
    # weight in vocabulary chunks, so the [tokens, vocab] logits never exist (recomputed in the backward)
    fused_lm_head: bool = False
    # verl's remove padding: each micro-batch's samples end to end in one row (THD: Megatron's PackedSeqParams), so
    # no position is computed for padding (hybridrl/megatron/sequences.py); false: a row per sample, padded
    use_remove_padding: bool = True
    # Megatron TransformerConfig fields set verbatim, e.g. recompute_granularity: full, recompute_method:
    # uniform, recompute_num_layers: 1 (activation recompute); unknown keys are an error
    override_transformer_config: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    optimizer: str = "adam"  # one of OPTIMIZERS
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # one of LR_DECAY_STYLES
    # Megatron OptimizerConfig fields set verbatim (verl's key), e.g. optimizer_cpu_offload: true,
    # optimizer_offload_fraction: 1; the accepted keys and their rules: hybridrl.megatron.optimizer_overrides
    override_optimizer_config: dict[str, Any] = field(default_factory=dict)


LAYOUT_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "context_parallel_size", "sequence_parallel", "expert_model_parallel_size",
                "expert_tensor_parallel_size")


ROUTER_REPLAY_MODES: tuple[str, ...] = ("disabled", "R2", "R3")


@dataclass(kw_only=True, slots=True)
class RouterReplayConfig:
    """``actor_rollout_ref.actor.router_replay`` (verl's key), an MoE actor's router replay
    (:mod:`hybridrl.megatron.router_replay`): ``disabled``; ``R2``, the update routes as the old-log-prob pass did;
    ``R3``, the old-log-prob pass and the update route as the rollout engine did."""

    mode: str = "disabled"


@dataclass(kw_only=True, slots=True)
class RefMegatronConfig:
    """The ref shares the actor's Megatron process groups, so its layout *is* the actor's: every size
    follows the actor (null); an explicit value must equal the actor's (validation says so otherwise)."""

    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int | None = None
    sequence_parallel: bool | None = None
    expert_model_parallel_size: int | None = None
    expert_tensor_parallel_size: int | None = None
    param_offload: bool = False  # the ref's own: its weights wait in host memory outside its log-prob pass
    use_remove_padding: bool | None = None  # its passes' layout (packed or padded); null: the actor's

    def mismatches(self, actor: MegatronConfig) -> list[tuple[str, object, object]]:
        """``(key, ref value, actor value)`` for every explicit size that differs from the actor's."""
        out = []
        for name in LAYOUT_SIZES:
            mine, theirs = getattr(self, name), getattr(actor, name)
            if mine is not None and mine != theirs:
                out.append((name, mine, theirs))
        return out


@dataclass(kw_only=True, slots=True)
class CriticMegatronConfig(RefMegatronConfig):
    """The critic shares the actor's Megatron process groups too: sizes follow the actor (null) or must equal
    it; ``dtype``, ``use_distributed_optimizer`` and ``override_transformer_config`` are the actor's. The
    memory phases are the critic's own (verl's keys, as the actor's)."""

    grad_offload: bool = False
    optimizer_offload: bool = False

    def resolve(self, actor: MegatronConfig) -> MegatronConfig:
        """The critic's full Megatron config: the actor's, with the critic's own offload switches."""
        return replace(actor, param_offload=self.param_offload, grad_offload=self.grad_offload,
                       optimizer_offload=self.optimizer_offload)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n >= 1 else []


class ParallelSizes(Protocol):
    """A role's Megatron sizes: ``MegatronConfig`` (config) and ``ParallelConfig`` (runtime) both are."""

    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    context_parallel_size: int
    sequence_parallel: bool
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int | None


def expert_tp(m: ParallelSizes) -> int:
    """The experts' TP: ``expert_tensor_parallel_size``, or the model's TP when null (Megatron's default)."""
    return m.expert_tensor_parallel_size if m.expert_tensor_parallel_size is not None else m.tensor_model_parallel_size


def layout_problems(m: ParallelSizes, *, world_size: int | None,
                    transformer_engine: bool | None = None) -> list[tuple[str, object, str]]:
    """Megatron's rules for one role's sizes, as ``(key under megatron, value, message)``; the runtime's
    ``ParallelConfig`` raises from the same list. ``world_size=None``: skip the world-size rule;
    ``transformer_engine=None``: skip the rule that needs to know whether TE is installed."""
    out: list[tuple[str, object, str]] = []
    sizes = {"tensor_model_parallel_size": m.tensor_model_parallel_size,
             "pipeline_model_parallel_size": m.pipeline_model_parallel_size,
             "context_parallel_size": m.context_parallel_size}
    out += [(k, v, "must be ≥ 1") for k, v in sizes.items() if v < 1]
    tp, pp, cp = (max(v, 1) for v in sizes.values())
    if world_size is not None and world_size % (tp * pp * cp):
        valid = divisors(world_size // (pp * cp)) if world_size % (pp * cp) == 0 else []
        out.append(("tensor_model_parallel_size", tp,
                    f"TP×PP×CP = {tp}×{pp}×{cp} = {tp * pp * cp} must divide the world size {world_size} "
                    f"(valid TP for PP={pp}, CP={cp}: {valid})"))
    vpp = m.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp < 2:
        out.append(("virtual_pipeline_model_parallel_size", vpp,
                    "must be null (one model chunk per stage, plain 1F1B) or ≥ 2 chunks per stage"))
    if vpp is not None and pp < 2:
        out.append(("virtual_pipeline_model_parallel_size", vpp,
                    f"the interleaved schedule needs pipeline_model_parallel_size ≥ 2 (it is {pp}); "
                    "set null or raise PP"))
    ep, etp = m.expert_model_parallel_size, expert_tp(m)
    if ep < 1:
        out.append(("expert_model_parallel_size", ep, "must be ≥ 1"))
    if etp < 1:
        out.append(("expert_tensor_parallel_size", etp, "must be ≥ 1 or null (the model's TP)"))
    elif m.expert_tensor_parallel_size is not None and etp != tp and ep >= 1:
        if world_size is not None and world_size % (tp * pp * cp) == 0 and (world_size // pp) % (etp * ep):
            rest = world_size // pp
            out.append(("expert_model_parallel_size", ep,
                        f"EP×ETP = {ep}×{etp} (expert_tensor_parallel_size={etp}) must divide the {rest} ranks of "
                        f"each pipeline stage (Megatron's expert grid takes them from the TP×CP×DP ranks); valid EP "
                        f"at this ETP: "
                        f"{[d for d in divisors(rest) if rest % (d * etp) == 0]}"))
    elif ep >= 1 and world_size is not None and world_size % (tp * pp * cp) == 0 and (world_size // (tp * pp)) % ep:
        rest = world_size // (tp * pp)
        out.append(("expert_model_parallel_size", ep,
                    f"must divide the {rest} ranks of each pipeline stage's TP replica (world {world_size} / "
                    f"(TP×PP = {tp}×{pp}): Megatron takes the expert ranks from the data- and context-parallel "
                    f"ones); valid: {divisors(rest)}"))
    if m.sequence_parallel and tp == 1:
        out.append(("sequence_parallel", True, "needs tensor_model_parallel_size > 1"))
    if m.sequence_parallel and transformer_engine is False:
        out.append(("sequence_parallel", True,
                    "needs Transformer Engine (Megatron's torch-norm fallback does not support it); set false"))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatching:
    """How one pass cuts a DP rank's samples: fixed-size micro-batches, or a token budget each."""

    micro_batch_size: int  # samples per micro-batch (unused with a token budget)
    # use_dynamic_bsz: tokens per micro-batch (packed: their sum; padded: rows × longest row)
    max_tokens: int | None = None
    shared_prompts: bool = False  # use_prefix_grouper: a prompt's samples share one row (prefix_grouper)
    packed: bool = False  # use_remove_padding: a micro-batch's samples end to end in one row (sequences.py)

    def __str__(self) -> str:
        unit = "tokens" if self.packed else "padded tokens"
        size = f"≤ {self.max_tokens} {unit}" if self.max_tokens else f"{self.micro_batch_size} samples"
        return size + (", shared-prompt rows" if self.shared_prompts else "") + (", packed" if self.packed else "")


def interleaved_micro_batches_problem(pp: int, vpp: int) -> str:
    """Megatron's interleaved schedule (0.16.1, ``forward_backward_pipelining_with_interleaving``) runs
    micro-batches in groups of ``microbatch_group_size_per_vp_stage`` (default PP) and refuses a count
    that is not a multiple of it. Log-prob passes are padded by the policy; optimizer steps can't be."""
    return (f"the interleaved pipeline schedule (virtual_pipeline_model_parallel_size={vpp}) needs a multiple of "
            f"PP={pp} micro-batches per optimizer step")
