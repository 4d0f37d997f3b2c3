"""The contracts between the RL loop and its plugins.

Every plugin is a class with a nested kw-only ``Config`` dataclass (possibly empty) and is built by
the registry as ``cls(config, **ctx)``; the context each group receives is documented on its
protocol. Shapes: ``B`` samples (prompts × n), ``T`` response tokens (right-padded).
Class attributes (``needs_group``, ``needs_critic``) are read by the static config validation
before anything heavy is built, so they must not require instantiation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from hybridrl.batch import RolloutBatch, SampleMeta
    from hybridrl.data.collate import PromptBatch
    from hybridrl.metrics import Timer

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
    # an MoE model: also return the experts the engine routed each token to (Generation.routed_experts; R3 router
    # replay); only for an engine whose ``supports_routed_experts`` is True
    return_routed_experts: bool = False


def check_limits(max_new_tokens: Sequence[int] | None, prompts: Sequence[Any], params: SamplingParams) -> list[int]:
    """``RolloutEngine.generate``'s per-prompt caps, checked (one per prompt, 0 ≤ cap ≤ params.max_new_tokens)."""
    if max_new_tokens is None:
        return [params.max_new_tokens] * len(prompts)
    caps = [int(c) for c in max_new_tokens]
    if len(caps) != len(prompts) or not all(0 <= c <= params.max_new_tokens for c in caps):
        raise ValueError(f"max_new_tokens: one cap per prompt ({len(prompts)}), each in 0..{params.max_new_tokens} "
                         f"(params.max_new_tokens); got {len(caps)} caps in "
                         f"{min(caps, default=0)}..{max(caps, default=0)}")
    return caps


@dataclass(slots=True, kw_only=True)
class Generation:
    """One sampled response."""

    prompt_index: int  # which input prompt it answers
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution (0.0 where not sampled)
    # "stop" (EOS / stop token) or "length"; "abort": cut short by an interrupted engine (``abort``), a partial
    # output that the rollout continues and never trains as it is; a multi-turn episode of a vision-language policy
    # also "vision_token" (it sampled an image placeholder id: hybridrl.rollout.episodes)
    finish_reason: str
    weight_version: int  # the oldest version that sampled any of its tokens
    # 1 where the policy sampled the token (trained on), 0 where it did not (a tool's output, a template
    # separator of a multi-turn response); None: every token was sampled (an engine's own output)
    loss_mask: list[int] | None = None
    # the weight version that sampled each token (a partial rollout continued on newer weights spans several);
    # None: every token was sampled at ``weight_version``
    token_versions: list[int] | None = None
    # [prompt + response tokens − 1, MoE layers, top-k] int16: the experts the engine chose for each position it
    # ran (the prompt's, then each sampled token's but the last, which it never fed back), MoE layers in order;
    # None unless SamplingParams.return_routed_experts
    routed_experts: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineMemory:
    """A rollout engine's device memory as the plan counts it (``RolloutEngine.memory_budget``)."""

    fraction: float  # of each device, taken at start for weights + KV pool (+ workspace): vLLM's utilization
    kv_pool_bytes: float | None = None  # a KV pool of this size instead (weights on top of it); fraction unused
    weights_released: bool  # release_memory frees the weights' device memory for the train phase
    kv_released: bool  # release_memory frees the KV pool


@dataclass(slots=True, kw_only=True)
class TokenScores:
    """A model's view of the tokens ``starts[i]..len(sequence) − 1`` of one scored sequence (teacher-forced): the
    log-prob of each token given the ones before it under softmax(logits / temperature), and, with ``topk`` > 0, the
    ``topk`` most likely tokens at each of those positions (most likely first) with their log-probs. A rollout
    engine's optional ``score`` returns one per sequence."""

    logprobs: torch.Tensor  # [n] float32, n = len(sequence) − start
    topk_ids: torch.Tensor | None = None  # [n, K] long
    topk_logprobs: torch.Tensor | None = None  # [n, K] float32


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses from token ids; holds its own copy of the policy weights.

    Built with ctx: ``model_path: str``, ``device: torch.device``, ``tp_size: int`` (the engine's
    tensor-parallel size; the engine spans ``tp_size`` devices starting at ``device``) and
    ``gpu_memory_utilization: float`` (``actor_rollout_ref.rollout.gpu_memory_utilization``, verl's key: the
    share of each GPU the engine may take for weights and KV cache; an engine without a memory pool ignores
    it); an engine takes ``**ctx`` so that later context keys do not break it.
    """

    Config: ClassVar[type]
    supports_tensor_parallel: ClassVar[bool]  # False: validation rejects rollout.tensor_model_parallel_size > 1
    # Optional classmethod ``plan_notes(config, *, device_type: str, tp_size: int) -> list[str]``: lines ``hybridrl
    # validate`` prints with the plan (e.g. what the engine cannot do on this device); a ValueError is a config error.
    # Optional classmethod ``memory_budget(config, *, device_type: str, gpu_memory_utilization: float) ->
    # EngineMemory | None``: what the plan's memory check counts for the engine (None or absent: its bf16 weights
    # plus the KV cache of its whole share of a step, held only while it generates).
    # Optional static method ``model_problem(model_path: str, *, device_type: str) -> str | None``: why the engine
    # can't serve that checkpoint on that device (validation reports it at rollout.name, before any model is built).
    # Optional interruption (``supports_abort = True``; ``async_training.partial_rollout`` needs it): ``abort()``,
    # called from another thread, makes the running ``generate`` (and any started before ``resume()``) return soon,
    # each unfinished sample with the tokens it has and ``finish_reason="abort"``; ``resume()`` ends that. The
    # weights may be updated in between (hybridrl.rollout.partial continues the samples on them).
    # Optional scoring (a distillation teacher served by the engine on ranks of its own,
    # ``actor_rollout_ref.teacher.inference``): ``score(sequences, *, starts, topk, temperature) -> list[TokenScores]``,
    # see :class:`TokenScores`; an engine without it cannot be a teacher's (validation says so).

    def generate(self, prompts: Sequence[list[int]], params: SamplingParams, *,
                 seeds: Sequence[int] | None = None,
                 max_new_tokens: Sequence[int] | None = None) -> list[Generation]:
        """``params.n`` samples per prompt, prompt-major (all of prompt 0's, then prompt 1's, ...).

        Optional images (a vision-language model; an engine with ``supports_images = True``, validation refuses
        images for the others): ``images[i]`` (:class:`hybridrl.vlm.inputs.ImageInputs` or None) are prompt ``i``'s,
        whose ids already hold each image's ``<|image_pad|>`` placeholders, expanded; the rollout passes
        ``images=`` only when a prompt of the call has one.

        ``max_new_tokens[i]`` (each ≤ ``params.max_new_tokens``; None: that for all) caps prompt ``i``'s samples: a
        multi-turn rollout's episodes have different budgets left. Optional: the rollout passes it only to an
        engine whose ``generate`` takes it (and otherwise cuts the samples itself), so an older engine still runs;
        an engine with a context limit (SGLang) needs it, since the call's largest budget plus the longest context
        may exceed the limit.

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
class Scored:
    """A batch's reward as the loop receives it."""

    output: RewardOutput  # scores_B: one float per sample (0.0 for a failed sample under on_error=zero)
    errors: int  # samples that failed and scored 0.0 (always 0 under on_error=raise)


class PendingScores(Protocol):
    """A batch's reward on its way (it may be computed while the log-prob passes run)."""

    def result(self) -> Scored:
        """Wait for the scores (``reward.*``'s time limit and on_error applied)."""


@dataclass(slots=True, kw_only=True)
class RolloutStep:
    """What a :class:`Rollout` hands the loop for one RL step."""

    batch: RolloutBatch  # this rank's DP share of the step's samples
    scores: PendingScores  # their reward, maybe still being computed
    metrics: dict[str, float] = field(default_factory=dict)  # the rollout's own, the same on every rank


@runtime_checkable
class Rollout(Protocol):
    """The seam between the RL loop and everything that produces a step's samples: prompts, the engines (their
    placement, routing, memory phases), sampling, submitting the reward, weight sync and weight versions.

    The loop asks for a step's scored batch and never branches on how it was made. Implementations: the
    single-turn rollout over the colocated engines (:mod:`hybridrl.rollout.single_turn`); DAPO's dynamic
    sampling, a rollout that wraps another (:mod:`hybridrl.rollout.dynamic_sampling`). Every rank runs the same
    calls (SPMD); a rollout's collectives are its own business.
    """

    @property
    def weight_version(self) -> int:
        """The version of the weights the engines hold (0 = the start model; +1 per sync)."""

    def step(self, *, seed: int, timer: Timer) -> RolloutStep:
        """The next step's samples and their pending scores; ``timer`` records ``gen`` and ``reward`` time."""

    def generate(self, prompts: PromptBatch, params: SamplingParams, *, seed: int) -> RolloutBatch:
        """``params.n`` samples of each prompt of ``prompts`` (the same batch on every rank), unscored: this
        rank's DP share. Evaluation samples through it."""

    def sync_weights(self, *, version: int | None = None) -> float:
        """Put the actor's current weights into the engines as ``version`` (default: the next one); the MB sent."""

    def shutdown(self) -> None:
        """Stop the engines (the rollout owns them) and whatever else it runs."""


@runtime_checkable
class ResumableRollout(Rollout, Protocol):
    """A rollout with a position of its own that a checkpoint must hold (the asynchronous rollout draws batches
    ahead of the trainer, so the loader's position is not the trained one)."""

    def state_dict(self) -> dict[str, Any]:
        """Saved with each checkpoint; its ``"sampler"`` entry is the data position a resumed run draws from."""

    def load_state_dict(self, state: dict[str, Any] | None, *, step: int) -> None:
        """Continue after ``step`` trained steps; ``state`` None: the checkpoint was written without one."""


@dataclass(slots=True, kw_only=True)
class RewardOutput:
    scores_B: torch.Tensor  # [B] sequence-level score, placed on the last trained (loss_mask) token by the loop
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

    Every estimator class declares ``needs_group`` and ``needs_critic`` (the registry rejects one that does not);
    ``needs_teacher`` has a default, False, which the registry gives a class that does not declare it. An estimator
    that needs a teacher distills from ``actor_rollout_ref.teacher`` (validation requires one) and is also called
    with ``logprobs_BT`` (the actor's log π_old of each sampled token) and ``teacher_logprobs_BT`` (the teacher's),
    both ``[B, T]`` (``hybridrl/algorithms/advantages/opd.py``).
    """

    Config: ClassVar[type]
    needs_group: ClassVar[bool]  # compares samples of one prompt: requires rollout.n >= 2
    needs_critic: ClassVar[bool]  # consumes values: requires a critic (value model)
    needs_teacher: ClassVar[bool] = False  # reads the teacher's log-probs: requires actor_rollout_ref.teacher

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
    """The actor's surrogate objective. Built with no ctx. Optional ``trust_region: ClassVar[bool]`` (absent:
    False): the objective is clipped, which ``async_training`` requires for off-policy samples."""

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


@dataclass(slots=True, kw_only=True)
class EnvStep:
    """What an environment says after the assistant's turn."""

    messages: list[dict[str, Any]]  # chat messages ({"role": ..., "content": ...}) appended to the conversation
    done: bool  # the episode is over (no further assistant turn)
    reward: float | None = None  # this step's reward (None: none)
    info: dict[str, Any] = field(default_factory=dict)
    # the policy's turn is kept up to its first ``keep_tokens`` sampled ids (an agent's ``max_tokens`` or ``stop``;
    # only from ``Episode.step_turn``, which sees the ids); the rest leaves the sample as if never sampled, and the
    # template ends the turn. None: the whole turn
    keep_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyTurn:
    """The policy's latest turn with its tokens, for an episode that defines ``step_turn``."""

    text: str  # its content: the sampled ids decoded, without the ending EOS
    token_ids: list[int]  # as sampled (cut to the episode's budget), the ending EOS included
    logprobs: list[float]  # the engine's log-prob of each
    context_tokens: int  # the ids it was generated from (prompt + the response before it)
    params: SamplingParams  # what sampled it (the run's: actor_rollout_ref.rollout.*, or val_kwargs in validation)
    eos_token_id: int | None
    decode: Callable[[Sequence[int]], str]  # the policy's tokenizer: ids → text (special tokens kept)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolResult:
    """A tool's observation with images (verl's ``ToolResponse(text=, image=[...])``): the tool message shows the
    images first, then the text. A vision-language policy sees each image as the processor encodes it (its
    placeholders count in the response budget); a text policy's rollout refuses images (an error observation)."""

    text: str = ""
    images: Sequence[Any] = ()  # PIL images (converted to RGB)


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSample:
    """The sample a tool call serves, for a tool that asks for it (``Tool.takes_sample``): verl's per-trajectory
    ``create(instance_id, **create_kwargs)`` data."""

    meta: SampleMeta  # the dataset row: ground_truth (data.ground_truth_key), data_source, extra (its other columns)
    # the row's extra_info.tools_kwargs.<the tool's schema name>.create_kwargs (verl's layout); {} where it has none
    create_kwargs: Mapping[str, Any]
    # the sample's decoded images so far (PIL, RGB), in sequence order: its prompt's, then earlier tool results'
    images: Sequence[Any] = ()

    @classmethod
    def of(cls, meta: SampleMeta, name: str, *, images: Sequence[Any] | None = None) -> ToolSample:
        """What tool ``name`` (its schema's function name, as verl keys ``tools_kwargs``) gets of the row ``meta``
        (a missing level, or None where a parquet struct left one empty, is no kwargs); ``images``: the episode's
        images so far (None: the prompt's)."""
        node: Any = meta.extra
        for key in ("extra_info", "tools_kwargs", name, "create_kwargs"):
            node = node.get(key) if isinstance(node, Mapping) else None
        if images is None:
            images = list(meta.images.images) if meta.images is not None else []
        return cls(meta=meta, create_kwargs=dict(node) if isinstance(node, Mapping) else {}, images=list(images))


@runtime_checkable
class Tool(Protocol):
    """A function the policy can call by ``schema["function"]["name"]`` in a multi-turn rollout (group
    ``hybridrl.tools``, config key ``actor_rollout_ref.rollout.multi_turn.tools``). Built with no ctx (a tool
    takes ``**ctx`` so that later context keys do not break it).

    ``schema`` is an OpenAI function schema ``{"type": "function", "function": {"name", "description",
    "parameters"}}``. ``__call__`` returns the observation text the policy reads next, or a :class:`ToolResult` with
    images as well (a vision-language policy's); it may be a coroutine function. An exception is an error
    observation for the policy, never a crash of the run.

    Opt-in: a tool whose class sets ``takes_sample: ClassVar[bool] = True`` is called
    ``tool(arguments, sample=ToolSample)``, with the sample the call serves (its row's ground truth and per-tool
    ``create_kwargs``: what verl hands a tool's ``create``); any other is called ``tool(arguments)``.
    """

    Config: ClassVar[type]
    schema: dict[str, Any]

    def __call__(self, arguments: dict[str, Any]) -> str | ToolResult: ...


@runtime_checkable
class Episode(Protocol):
    """One environment episode: :meth:`step` answers each assistant turn (``{"role": "assistant", "content": str}``);
    it may be a coroutine function. ``close()`` is optional; so is ``step_turn(turn: PolicyTurn) -> EnvStep``, which
    the rollout calls instead of ``step`` where it is defined (an episode that needs the turn's tokens)."""

    def step(self, message: dict[str, Any]) -> EnvStep: ...


@runtime_checkable
class Environment(Protocol):
    """Opens an episode per sample (group ``hybridrl.environments``, config key
    ``actor_rollout_ref.rollout.multi_turn.environment``). Built with no ctx (takes ``**ctx``)."""

    Config: ClassVar[type]

    def open(self, meta: SampleMeta, *, seed: int) -> Episode: ...
