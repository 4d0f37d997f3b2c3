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
and checked against the chosen plugin's own ``Config`` dataclass by ``validate.py``; each holds flat keys and/or
one block per plugin name, used only when that plugin is chosen (``plugin_kwargs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from hybridrl.algorithms.distillation_loss import DistillationLossConfig
from hybridrl.algorithms.dynamic_sampling import FilterGroupsConfig
from hybridrl.algorithms.kl_controller import KLControlConfig
from hybridrl.algorithms.rollout_correction import RolloutCorrectionConfig
from hybridrl.megatron.config import (
    CriticMegatronConfig,
    MegatronConfig,
    OptimConfig,
    RefMegatronConfig,
    RouterReplayConfig,
)
from hybridrl.rewards.execution import RewardConfig
from hybridrl.rollout.async_training import AsyncTrainingConfig
from hybridrl.tools.config import MultiTurnConfig

DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")  # trainer.device
ROLLOUT_MODES: tuple[str, ...] = ("sync", "async")  # actor_rollout_ref.rollout.mode (verl's values)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = MISSING  # HF checkpoint directory: config.json + *.safetensors + tokenizer
    tokenizer_path: str | None = None  # defaults to path
    # build the checkpoint at `path` when it does not exist: "tiny" (random tiny model) or
    # "sft:<recipe>" (run that SFT recipe, saving to `path`); see hybridrl/bootstrap.py
    build_if_missing: str | None = None
    # LoRA (verl's keys; hybridrl/lora/config.py): rank 0 = off (full fine-tuning); scale = alpha / rank;
    # target_modules: a list of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj (or Megatron's
    # linear_qkv linear_proj linear_fc1 linear_fc2), or "all-linear"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: Any = "all-linear"
    lora_dropout: float = 0.0
    # activation recompute in the actor/ref/critic (verl's key): Megatron's full recompute, uniform, one layer per
    # checkpoint unless megatron.override_transformer_config sets recompute_* itself
    enable_gradient_checkpointing: bool = False
    # fields of the checkpoint's config.json overridden (verl's key): max_position_embeddings only, the longest
    # sequence the model takes (its rotary positions depend on no such bound); the engines get it too
    override_config: dict[str, Any] = field(default_factory=dict)


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
    # update and log-prob passes and the ref's; needs Megatron's local attention, CP = 1, no VPP. null: on where it
    # runs and packing is on (config/batch_plan.py: shared_prompt_rows), off elsewhere — it is exact either way
    use_prefix_grouper: bool | None = None
    # a vision-language model's vision tower (and merger) stays as loaded: no gradients, no optimizer state (verl's key)
    freeze_vision_tower: bool = False
    ppo_epochs: int = 1
    shuffle: bool = False  # shuffle samples between PPO epochs
    loss_agg_mode: str = "token-mean"  # one of hybridrl.algorithms.loss_agg.LOSS_AGG_MODES
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False  # KL(actor || ref) as a loss term (GRPO style)
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"  # one of hybridrl.algorithms.kl.KL_KINDS
    # an MoE actor's router replay: disabled | R2 | R3 (hybridrl/megatron/router_replay.py)
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)


@dataclass(kw_only=True, slots=True)
class RefConfig:
    # null: built only when a KL term needs it (actor.use_kl_loss or algorithm.use_kl_in_reward)
    enable: bool | None = None
    megatron: RefMegatronConfig = field(default_factory=RefMegatronConfig)
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool | None = None  # null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # null: actor.ppo_max_token_len_per_gpu


@dataclass(kw_only=True, slots=True)
class TeacherModelConfig:
    # HF checkpoint of the on-policy distillation teacher (null: no teacher); its tokenizer must be the student's
    path: str | None = None
    tokenizer_path: str | None = None  # defaults to path
    build_if_missing: str | None = None  # as actor_rollout_ref.model.build_if_missing


@dataclass(kw_only=True, slots=True)
class TeacherInferenceConfig:
    """Where the teacher runs. ``name`` null: Megatron, in the actor's layout on the trainer ranks. A rollout engine
    plugin's name (``hf``, ``sglang``, ``vllm``): that engine serves the teacher on ``num_ranks`` ranks of its own
    (the last of the launch, after any disaggregated rollout's), one engine per ``tensor_model_parallel_size`` of
    them, and scores each step's samples there (verl's ``distillation.teacher_models.*.inference`` on its own
    ``distillation.nnodes`` × ``n_gpus_per_node`` GPUs): :mod:`hybridrl.rollout.teacher_service`."""

    name: str | None = None
    num_ranks: int = 1
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5  # as rollout.gpu_memory_utilization, for the teacher's engine
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # the engine plugin's Config

    @property
    def on_engine(self) -> bool:
        return self.name is not None


@dataclass(kw_only=True, slots=True)
class TeacherConfig:
    """A frozen model that scores every sampled token (on-policy distillation: ``algorithm.adv_estimator=opd`` or
    ``grpo_opd``, or a supervised distillation term in the actor's loss: ``loss``), built like the ref: no gradients,
    no optimizer, in the actor's layout (its sizes follow the actor or must equal it), its log-probs computed where
    the ref's are and its weights offloaded as the ref's."""

    model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)
    megatron: RefMegatronConfig = field(default_factory=RefMegatronConfig)
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool | None = None  # null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # null: actor.ppo_max_token_len_per_gpu

    @property
    def enabled(self) -> bool:
        return self.model.path is not None


@dataclass(kw_only=True, slots=True)
class RolloutValConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    do_sample: bool = True  # false: greedy whatever temperature says (verl's key; greedy is temperature=0 too)

    @property
    def sampling_temperature(self) -> float:
        return self.temperature if self.do_sample else 0.0


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    name: str = "hf"  # rollout engine plugin (group hybridrl.rollout_engines)
    # sync: the step waits for its rollouts; async: verl's agent-loop server mode, the same on-policy step here
    # (hybridrl's engines already serve each request, and each multi-turn episode, on its own)
    mode: str = "sync"
    # share of each GPU the engine takes for its weights + KV pool (vLLM's gpu_memory_utilization, SGLang's
    # mem_fraction_static); the memory check counts it. verl's key and default; the hf engine has no pool
    gpu_memory_utilization: float = 0.5
    n: int = 1  # samples per prompt
    tensor_model_parallel_size: int = 1  # ranks per engine
    # colocated: an engine on every rank's devices, asleep while they train | disaggregated: engines on the last
    # num_ranks ranks only, the others train (hybridrl/rollout/async_training.py)
    placement: str = "colocated"
    num_ranks: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    log_prob_micro_batch_size_per_gpu: int = 8
    log_prob_use_dynamic_bsz: bool | None = None  # null: actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: int | None = None  # null: actor.ppo_max_token_len_per_gpu
    update_weights_bucket_megabytes: int = 512
    val_kwargs: RolloutValConfig = field(default_factory=RolloutValConfig)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # the engine plugin's Config
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # tool-calling, multi-turn rollouts


@dataclass(kw_only=True, slots=True)
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
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
    loss_agg_mode: str = "token-mean"  # one of hybridrl.algorithms.loss_agg.LOSS_AGG_MODES


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # group hybridrl.advantage_estimators
    adv_estimator_kwargs: dict[str, Any] = field(default_factory=dict)
    policy_loss: str = "ppo_clip"  # group hybridrl.policy_losses
    policy_loss_kwargs: dict[str, Any] = field(default_factory=dict)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO dynamic sampling
    use_kl_in_reward: bool = False  # PPO-style KL penalty subtracted from token rewards
    kl_penalty: str = "k1"  # estimator for the in-reward KL: one of hybridrl.algorithms.kl.KL_KINDS
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)  # the coefficient β (verl's keys)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # parquet / jsonl
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    ground_truth_key: str = "ground_truth"
    # a vision-language model's prompts: the column of each row's images (verl's key; hybridrl.data.multimodal)
    image_key: str = "images"
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
    # prompts longer than max_prompt_length: dropped (counted warning) when true; else cut as `truncation` says
    # (verl's keys; verl's default is false)
    filter_overlong_prompts: bool = True
    truncation: str = "error"  # error (names the file and row) | left | right | middle: which tokens are kept


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    # as verl resolves them: total_training_steps when set, else total_epochs × ⌊rows of data.train_files /
    # data.train_batch_size⌋ (rows as read, before the length filter)
    total_training_steps: int | None = None
    total_epochs: int = 30
    # the first critic_warmup steps train the critic only: the actor updates from step critic_warmup on (verl's)
    critic_warmup: int = 0
    # verl's: within each mini-batch, the samples go to the DP ranks so that each gets about the same number of
    # tokens (which samples form a mini-batch never depends on the DP size); false: in order, equal sample counts
    balance_batch: bool = True
    seed: int = 1
    output_dir: str = "outputs/run"
    # entries of hybridrl.tracking.LOGGERS (wandb, tensorboard, mlflow: pip install 'hybridrl[<name>]')
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # steps (1..total_training_steps) traced with torch.profiler, per rank, into <output_dir>/profile/
    # (Chrome trace + a top-ops table printed at the end; hybridrl/trainers/profiling.py)
    profile_steps: list[int] = field(default_factory=list)
    project_name: str = "hybridrl"
    experiment_name: str = "run"
    device: str = "auto"  # one of DEVICES
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
    save_freq: int = -1  # checkpoint every N steps and at the end (≤ 0 = never; verl's key and default)
    max_checkpoints_to_keep: int = 3  # older complete checkpoints are deleted (0 = keep all)
    resume: str = "auto"  # auto (newest complete checkpoint in output_dir, if any) | never | <checkpoint dir>
    # SIGTERM/SIGUSR1 (Slurm's preemption or time limit, torchrun's forward): the run stops after the step in
    # flight, saves it and exits 0 within this many seconds, else exits 143 (hybridrl/preemption.py); below the
    # scheduler's grace period and torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s unless set)
    preempt_grace_s: float = 20.0
    save_hf_weights: bool = False  # also write the actor as an HF checkpoint into each checkpoint's hf/
    # every step's samples as <dir>/<step>.jsonl (text, score, turns, response ids and loss mask); null: none
    rollout_data_dir: str | None = None


@dataclass(kw_only=True, slots=True)
class RLConfig:
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)  # verl's block
