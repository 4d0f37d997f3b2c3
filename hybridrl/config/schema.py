"""The typed config tree of a hybridrl run (registered in Hydra's ConfigStore by ``store.py``).

The tree is the run's topology: ``actor_rollout_ref`` is the composite node (actor, ref, rollout,
each with its own parallel sizes), then ``reward``, ``algorithm``, ``data``, ``trainer``.
Where a concept is the same as in verl, the key has verl's name so overrides carry over
(``actor_rollout_ref.actor.ppo_mini_batch_size``, ``algorithm.adv_estimator``, ...).

Batch units follow verl: ``data.train_batch_size`` and ``actor.ppo_mini_batch_size`` count
*prompts* (each expands to ``rollout.n`` samples); ``*_micro_batch_size_per_gpu`` counts *samples*
per data-parallel rank.

Plugin blocks (``reward.kwargs``, ``algorithm.adv_estimator_kwargs``,
``algorithm.policy_loss_kwargs``, ``actor_rollout_ref.rollout.engine_kwargs``) are free-form here
and checked against the chosen plugin's own ``Config`` dataclass by ``validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import MISSING


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
    use_distributed_optimizer: bool = False
    # parameters and compute: float32 | bfloat16 | float16 (the last two keep fp32 main weights and grads in
    # the optimizer; float16 adds dynamic loss scaling); the ref runs in the actor's dtype
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
    # Megatron TransformerConfig fields set verbatim, e.g. recompute_granularity: full, recompute_method:
    # uniform, recompute_num_layers: 1 (activation recompute); unknown keys are an error
    override_transformer_config: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    optimizer: str = "adam"  # adam | sgd
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | linear | cosine


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = MISSING  # HF checkpoint directory: config.json + *.safetensors + tokenizer
    tokenizer_path: str | None = None  # defaults to path
    # build the checkpoint at `path` when it does not exist: "tiny" (random tiny model) or
    # "sft:<recipe>" (run that SFT recipe, saving to `path`); see hybridrl/bootstrap.py
    build_if_missing: str | None = None
    # LoRA (verl's keys; hybridrl/lora_config.py): rank 0 = off (full fine-tuning); scale = alpha / rank;
    # target_modules: a list of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (or Megatron's
    # linear_qkv linear_proj linear_fc1 linear_fc2), or "all-linear"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: Any = "all-linear"
    lora_dropout: float = 0.0


@dataclass(kw_only=True, slots=True)
class ActorConfig:
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 8  # prompts per optimizer step (× rollout.n samples)
    ppo_micro_batch_size_per_gpu: int = 4  # samples per forward/backward on one DP rank
    # micro-batches by token budget instead: samples grouped by length, each micro-batch padded to its
    # own longest row, rows × padded length ≤ ppo_max_token_len_per_gpu (ppo_micro_batch_size_per_gpu unused)
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    # a prompt's samples share one row, the prompt encoded once (megatron/prefix_grouper.py): the actor's
    # update and log-prob passes and the ref's; needs Megatron's local attention, CP = 1, no VPP
    use_prefix_grouper: bool = False
    ppo_epochs: int = 1
    shuffle: bool = False  # shuffle samples between PPO epochs
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False  # KL(actor || ref) as a loss term (GRPO style)
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # k1 | k2 | k3 | low_var_kl | abs


LAYOUT_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "context_parallel_size", "sequence_parallel")


@dataclass(kw_only=True, slots=True)
class RefMegatronConfig:
    """The ref shares the actor's Megatron process groups, so its layout *is* the actor's: every size
    follows the actor (null); an explicit value must equal the actor's (validation says so otherwise)."""

    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int | None = None
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int | None = None
    sequence_parallel: bool | None = None
    param_offload: bool = False  # the ref's own: its weights wait in host memory outside its log-prob pass

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


@dataclass(kw_only=True, slots=True)
class RefConfig:
    # null: built only when a KL term needs it (actor.use_kl_loss or algorithm.use_kl_in_reward)
    enable: bool | None = None
    megatron: RefMegatronConfig = field(default_factory=RefMegatronConfig)
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool | None = None  # null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # null: actor.ppo_max_token_len_per_gpu


@dataclass(kw_only=True, slots=True)
class RolloutValConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    name: str = "hf"  # rollout engine plugin (group hybridrl.rollout_engines)
    n: int = 1  # samples per prompt
    tensor_model_parallel_size: int = 1  # ranks per engine
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool | None = None  # null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # null: actor.ppo_max_token_len_per_gpu
    update_weights_bucket_megabytes: int = 512
    val_kwargs: RolloutValConfig = field(default_factory=RolloutValConfig)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # the engine plugin's Config


@dataclass(kw_only=True, slots=True)
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass(kw_only=True, slots=True)
class CriticModelConfig:
    # HF checkpoint of the critic's start (null: actor_rollout_ref.model.path): a causal LM (its trunk; the value
    # head starts small and random) or a *ForTokenClassification / *ForSequenceClassification with one label
    # (its score head is loaded); its vocabulary must be the actor's
    path: str | None = None


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """The value model of PPO (``hybridrl/megatron/critic.py``), verl's ``critic`` keys. Batch units as the
    actor's: ``ppo_mini_batch_size`` counts prompts, ``ppo_micro_batch_size_per_gpu`` samples per DP rank
    (also the micro-batch of the values pass)."""

    # null: built when algorithm.adv_estimator needs values (gae)
    enable: bool | None = None
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    megatron: CriticMegatronConfig = field(default_factory=CriticMegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))  # verl's critic lr
    ppo_mini_batch_size: int = 8
    ppo_micro_batch_size_per_gpu: int = 4
    use_dynamic_bsz: bool = False  # token-budget micro-batches (as actor.use_dynamic_bsz)
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    cliprange_value: float = 0.5  # ε of the clipped value loss: V stays within V_old ± ε (verl's default)
    loss_agg_mode: str = "token-mean"


@dataclass(kw_only=True, slots=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer``): a response longer than
    data.max_response_length − len loses up to penalty_factor of its score, linearly over the last len
    tokens (``hybridrl/rewards/overlong.py``)."""

    enable: bool = False
    len: int = 0  # L_cache: tokens before data.max_response_length where the penalty ramps from 0 to −1
    penalty_factor: float = 1.0  # the penalty at data.max_response_length (the paper: 1)


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    name: str = "arithmetic"  # reward manager plugin (group hybridrl.reward_managers)
    # one scoring pass over a rank's batch (null: no limit); past it a worker is killed, a thread abandoned and the
    # run stopped (see hybridrl/rewards/execution.py)
    timeout_s: float | None = 600.0
    # a reward call that raises, times out in a worker or crashes it: raise = stop the run naming the plugin, the
    # sample and the traceback; zero = re-score that part one sample at a time, failing samples score 0.0 and are
    # counted in reward/errors
    on_error: str = "raise"
    # 0: score in a thread of the trainer process; N > 0: in N spawned worker processes (killable; the plugin is
    # rebuilt in each from reward.name, reward.kwargs and the tokenizer path)
    num_workers: int = 0
    kwargs: dict[str, Any] = field(default_factory=dict)  # the reward plugin's Config
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO length penalty


@dataclass(kw_only=True, slots=True)
class KLControlConfig:
    """β of the KL-in-reward penalty (``algorithm.use_kl_in_reward``), as verl's ``algorithm.kl_ctrl``;
    the controller is ``hybridrl/algorithms/kl_controller.py``."""

    type: str = "fixed"  # fixed: β = kl_coef throughout | adaptive: Ziegler et al. 2019's controller
    kl_coef: float = 0.001  # β (adaptive: its initial value)
    target_kl: float = 0.1  # adaptive: the KL per token that β steers towards
    horizon: int = 10000  # adaptive: samples over which β may change by a factor of up to e^±0.2


@dataclass(kw_only=True, slots=True)
class RolloutCorrectionConfig:
    """Correction of the rollout-engine / trainer mismatch π_old / π_rollout, as verl's
    ``algorithm.rollout_correction`` (decoupled mode); off while both levels are null. Formulas,
    papers and deviations: ``hybridrl/algorithms/rollout_correction.py``."""

    rollout_is: str | None = None  # truncated IS weight min(ρ, rollout_is_threshold): token | sequence | null (off)
    rollout_is_threshold: float = 2.0  # C, the truncation of the IS weight (> 0)
    rollout_rs: str | None = None  # masked IS, drop tokens / sequences whose ρ leaves the band: token | sequence | null
    rollout_rs_threshold: float | None = None  # upper edge of the kept band; null: rollout_is_threshold
    rollout_rs_threshold_lower: float | None = None  # lower edge of the kept band (0: none); null: 1 / upper


@dataclass(kw_only=True, slots=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): groups whose samples all have the same
    metric are dropped and further rounds of data.gen_batch_size prompts are generated until
    data.train_batch_size groups are kept (``hybridrl/dynamic_sampling.py``)."""

    enable: bool = False
    metric: str = "acc"  # acc (the reward's correct_B; score > 0 without one) | score | seq_reward (+ overlong)
    # generation rounds per step at most (0: no limit); at the limit the step is filled up with dropped groups
    max_num_gen_batches: int = 0


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # group hybridrl.advantage_estimators
    adv_estimator_kwargs: dict[str, Any] = field(default_factory=dict)
    policy_loss: str = "ppo_clip"  # group hybridrl.policy_losses
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO dynamic sampling
    use_kl_in_reward: bool = False  # PPO-style KL penalty subtracted from token rewards
    kl_penalty: str = "k1"  # estimator for the in-reward KL
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)  # the coefficient β (verl's keys)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet / jsonl
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    ground_truth_key: str = "ground_truth"
    apply_chat_template: bool = True  # when the tokenizer has one
    max_prompt_length: int = 64  # tokens; longer prompts are dropped (counted warning)
    max_response_length: int = 64  # tokens generated at most
    train_batch_size: int = 8  # prompts per RL step
    # prompts per generation round under algorithm.filter_groups (null: train_batch_size); unused without it
    gen_batch_size: int | None = None
    val_batch_size: int = 64
    shuffle: bool = True
    # "arithmetic": write the synthetic task's train/val splits to train_files[0] / val_files[0]
    # when they do not exist (see hybridrl/bootstrap.py)
    build_if_missing: str | None = None


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    total_training_steps: int = 100
    seed: int = 1
    output_dir: str = "outputs/run"
    # console, jsonl, wandb, tensorboard, mlflow (the last three: pip install 'hybridrl[<name>]')
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # steps (1..total_training_steps) traced with torch.profiler, per rank, into <output_dir>/profile/
    # (Chrome trace + a top-ops table printed at the end; hybridrl/profiling.py)
    profile_steps: list[int] = field(default_factory=list)
    project_name: str = "hybridrl"
    experiment_name: str = "run"
    device: str = "auto"  # auto | cpu | cuda
    nnodes: int = 1
    n_gpus_per_node: int = 1  # ranks per node (CPU processes on a CPU machine)
    # memory of one GPU for the plan's memory check; null: the visible GPU's (80 when planning without one)
    device_memory_gb: float | None = None
    # every process group's timeout: a rank waiting longer in a collective fails (the world then stops);
    # must exceed the rollout engine's and the reward's own timeouts (validation checks)
    dist_timeout_s: float = 3600.0
    # a step with a non-finite reward/advantage/loss/grad norm is skipped; this many in a row stop the run
    max_consecutive_skipped_steps: int = 3
    test_freq: int = 10  # held-out evaluation every N steps (0 = never); also at start
    val_before_train: bool = True
    save_every: int = 0  # checkpoint every N steps and at the end (0 = never)
    max_checkpoints_to_keep: int = 3  # older complete checkpoints are deleted (0 = keep all)
    resume: str = "auto"  # auto (newest complete checkpoint in output_dir, if any) | never | <checkpoint dir>
    save_hf_weights: bool = False  # also write the actor as an HF checkpoint into each checkpoint's hf/


@dataclass(kw_only=True, slots=True)
class RLConfig:
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
