"""verl's config keys and what each is in hybridrl: the table behind ``docs/verl.md`` and the command-line check.

A verl launch script's overrides run here unchanged (with ``recipe=ppo_megatron_trainer``, whose defaults are
verl's). Each key verl's Megatron examples set is one of:

- ``same``: a hybridrl key of the same name and meaning (the schema has it; most keys are this: the list of
  :mod:`hybridrl.config.verl_same`); ``values`` renames
  verl's spelling of a value (``algorithm.adv_estimator=reinforce_plus_plus`` is hybridrl's ``reinforce_pp``);
- ``alias``: hybridrl spells it differently (``target``, and ``also``: more keys that take the same value); the
  override is rewritten to the hybridrl key, with a notice. Only on the command line: a recipe uses the hybridrl
  name, so the two can never disagree in one file; a command line that sets a key both ways with two values is an
  error;
- ``engine``: a rollout-engine knob verl sets at ``actor_rollout_ref.rollout``: it goes into
  ``actor_rollout_ref.rollout.engine_kwargs`` under the chosen engine's own name for it (``engines``), and has no
  effect on an engine without one (a notice says so);
- ``joint``: read with the other keys of its ``group`` once the config is composed
  (:mod:`hybridrl.config.verl_joint`: verl's placement of the rollout on its own GPUs, its distillation block, its
  expert grid, its tool YAML); ``allowed`` values are checked with the rest of the command line;
- ``ignored``: accepted, no effect here (``note`` says why), with a notice;
- ``refused``: cannot mean the same here; an error names what to use.

A key ending in ``.*`` stands for every key under it. The keys of verl's FSDP engine (``group`` FSDP), and an
``ignored`` key of that group set to a value only FSDP takes (``model_engine=fsdp``), are refused together, in one
line: hybridrl trains with Megatron.

``tests/config/test_verl_keys.py`` keeps this table, the schema and ``docs/verl.md`` in agreement;
``tests/config/test_verl_defaults.py`` compares ``recipe=ppo_megatron_trainer`` with verl's defaults key by key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config.verl_same import AOR, SAME

FSDP = "fsdp"  # group: verl's FSDP engine, refused in one line


@dataclass(frozen=True, slots=True, kw_only=True)
class VerlKey:
    key: str  # verl's dotted key; ending in ".*": every key under it
    status: str  # one of STATUSES
    target: str | None = None  # alias: the hybridrl key
    also: tuple[str, ...] = ()  # alias: more hybridrl keys that take the same value
    engines: dict[str, str] = field(default_factory=dict)  # engine: rollout engine name → its engine_kwargs key
    values: dict[str, str] = field(default_factory=dict)  # same, alias: verl's value → hybridrl's (others unchanged)
    allowed: tuple[object, ...] = ()  # ignored, joint: the values accepted (others are refused with the note); (): any
    # alias: overrides it brings along, each unless the command line sets that key itself
    implies: tuple[str, ...] = ()
    group: str = ""  # joint: the keys read together; FSDP: refused together
    note: str = ""

    def notice(self, engine: str | None = None, *, key: str | None = None) -> str:
        """The line said when ``key`` (this entry's own, or one under a ``.*`` entry) is read."""
        key = key or self.key
        if self.status == "alias":
            targets = ", ".join((str(self.target), *self.also))
            return f"verl's {key} is hybridrl's {targets}" + (f" ({self.note})" if self.note else "")
        if self.status == "engine":
            where = self.engines.get(engine or "")
            if where is None:
                return (f"verl's {key} has no effect with rollout engine {engine!r} (it is "
                        + ", ".join(f"{k}'s {v}" for k, v in self.engines.items()) + ")")
            return f"verl's {key} is {AOR}.rollout.engine_kwargs.{where} for engine {engine!r}"
        return f"verl's {key} has no effect in hybridrl: {self.note}"

    def refuses(self, value: object) -> bool:
        """A key set to a value that would change the run (``allowed`` names the harmless ones)."""
        if not self.allowed:
            return False
        return not any(value == a and type(value) is type(a) or (isinstance(a, str) and str(value) == a)
                       for a in self.allowed)


STATUSES = ("same", "alias", "engine", "joint", "ignored", "refused")


def lookup(key: str) -> VerlKey | None:
    """The table's entry for ``key``: its own, or the longest ``prefix.*`` entry above it."""
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if (entry := VERL_KEYS.get(".".join(parts[:i]) + ".*")) is not None:
            return entry
    return None



# the DAPO reward manager's kwargs, in verl's old (reward_model.) and current (reward.) layout
_REWARD_KWARGS = [e for p in ("reward_model.reward_kwargs", "reward.reward_kwargs") for e in (
    *(VerlKey(key=f"{p}.overlong_buffer_cfg.{k}", status="alias", target=f"reward.overlong_buffer.{k}")
      for k in ("enable", "len", "penalty_factor")),
    VerlKey(key=f"{p}.overlong_buffer_cfg.log", status="ignored",
            note="the overlong penalty is always logged (reward/overlong_*)"),
    VerlKey(key=f"{p}.max_resp_len", status="ignored",
            note="the overlong penalty counts from data.max_response_length"))]
_MCORE_ONLY = "hybridrl converts HF ↔ Megatron with its own exact converters (hybridrl verify-model)"
_FSDP_NOTE = "verl's FSDP engine's setting"
_TEACHER = "distillation.teacher_models.teacher_model"
_TEACHER_ENGINE = (f"{AOR}.teacher.inference: nnodes ≥ 1 puts the teacher on an engine on nnodes × n_gpus_per_node "
                   "ranks of its own, added to the launch; 0 (verl's default): in Megatron on the trainer's ranks")

# keys of verl's current scripts (verl 1dda039b: model_engine, the new lora/policy_loss/checkpoint_engine/reward
# layouts, distillation, one-step-off placement)
_CURRENT = [
    VerlKey(key="model_engine", status="ignored", allowed=("megatron",), group=FSDP,
            note="hybridrl trains with Megatron (verl's model_engine=megatron)"),
    VerlKey(key=f"{AOR}.actor.strategy", status="ignored", allowed=("megatron",), group=FSDP,
            note="hybridrl trains with Megatron"),
    VerlKey(key=f"{AOR}.ref.strategy", status="ignored", allowed=("megatron",), group=FSDP,
            note="hybridrl runs the ref in Megatron"),
    VerlKey(key="critic.strategy", status="ignored", allowed=("megatron",), group=FSDP,
            note="hybridrl trains the critic with Megatron"),
    *[VerlKey(key=k, status="refused", group=FSDP, note=_FSDP_NOTE) for k in (
        f"{AOR}.actor.fsdp_config.*", f"{AOR}.ref.fsdp_config.*", "critic.fsdp_config.*", "critic.model.fsdp_config.*",
        f"{AOR}.actor.ulysses_sequence_parallel_size", f"{AOR}.ref.ulysses_sequence_parallel_size",
        "critic.ulysses_sequence_parallel_size")],
    VerlKey(key="ray_kwargs.*", status="ignored",
            note="runs are launched by torchrun or Slurm (launch/slurm/), not on a Ray cluster: no runtime_env"),
    VerlKey(key=f"{AOR}.actor.policy_loss.loss_mode", status="alias", target="algorithm.policy_loss",
            values={"vanilla": "dual_clip"},
            note="the policy loss plugin: vanilla is dual_clip (PPO-clip with verl's clip_ratio_c), gspo, cispo, sapo"),
    VerlKey(key=f"{AOR}.model.lora.rank", status="alias", target=f"{AOR}.model.lora_rank",
            implies=(f"{AOR}.model.lora_alpha=32",),
            note="the lora block's alpha (32) comes with it unless the command line sets one"),
    VerlKey(key=f"{AOR}.model.lora.alpha", status="alias", target=f"{AOR}.model.lora_alpha"),
    VerlKey(key=f"{AOR}.model.lora.dropout", status="alias", target=f"{AOR}.model.lora_dropout"),
    VerlKey(key=f"{AOR}.model.lora.target_modules", status="alias", target=f"{AOR}.model.target_modules",
            note="Megatron's linear_qkv/linear_proj/linear_fc1/linear_fc2 or HF projection names"),
    VerlKey(key=f"{AOR}.model.lora.lora_A_init_method", status="ignored",
            note="A starts Kaiming-uniform as peft's, B at zero: the adapted model starts equal to the base "
                 "whatever A's init"),
    VerlKey(key=f"{AOR}.model.lora.lora_B_init_method", status="ignored", allowed=("zero",),
            note="B starts at zero, so that training starts from the base model"),
    VerlKey(key=f"{AOR}.model.lora.type", status="ignored", allowed=("lora",), note="plain LoRA only (no DoRA)"),
    VerlKey(key=f"{AOR}.model.lora.merge", status="ignored",
            note="the engines get the merged weights W + (alpha/rank)·B·A: the same model as verl's adapter sync"),
    VerlKey(key=f"{AOR}.model.lora.dropout_position", status="ignored", allowed=("pre",),
            note="dropout on the adapter's input (verl's pre)"),
    VerlKey(key=f"{AOR}.model.lora.exclude_modules", status="ignored", allowed=([], None),
            note="choose the adapted projections with lora.target_modules"),
    VerlKey(key=f"{AOR}.model.lora.adapter_path", status="ignored", allowed=(None,),
            note="adapters start fresh; resume a run's own with trainer.resume"),
    VerlKey(key=f"{AOR}.rollout.checkpoint_engine.update_weights_bucket_megabytes", status="alias",
            target=f"{AOR}.rollout.update_weights_bucket_megabytes"),
    VerlKey(key=f"{AOR}.rollout.checkpoint_engine.backend", status="ignored",
            note="the weights reach the engines by hybridrl's own path (colocated: in place on each device; "
                 "disaggregated: over the trainer-engine bridge)"),
    VerlKey(key=f"{AOR}.rollout.checkpoint_engine.custom_backend_module", status="ignored", allowed=(None,),
            note="no weight-transfer plugins: hybridrl's own path only"),
    VerlKey(key=f"{AOR}.rollout.prompt_length", status="alias", target="data.max_prompt_length",
            note="verl's follows data.max_prompt_length; set both, they must agree"),
    VerlKey(key=f"{AOR}.rollout.response_length", status="alias", target="data.max_response_length",
            note="the tokens generated; verl's follows data.max_response_length; set both, they must agree"),
    VerlKey(key=f"{AOR}.rollout.expert_parallel_size", status="ignored",
            note="the engine's own layout of the experts: set it through engine_kwargs.engine_args "
                 "(vLLM enable_expert_parallel) / server_args (SGLang ep_size)"),
    VerlKey(key=f"{AOR}.rollout.moe_tensor_parallel_size", status="ignored",
            note="the engine's own layout of the experts: set it through engine_kwargs.server_args (SGLang)"),
    VerlKey(key=f"{AOR}.rollout.multi_turn.tool_config_path", status="joint", group="tools",
            note=f"verl's tool YAML, read into {AOR}.rollout.multi_turn.tools and tool_kwargs.<tool>: an entry whose "
                 "class_name is a hybridrl tool plugin (its name or class path) is that tool, its config the plugin's; "
                 "verl's sandbox-fusion code tool is python, its Gsm8kTool gsm8k (the row's ground truth from its "
                 "extra_info.tools_kwargs); other classes are refused, each in one line (docs/multi-turn.md)"),
    VerlKey(key=f"{AOR}.rollout.multi_turn.max_user_turns", status="ignored",
            note="a tool turn follows each assistant turn with calls: multi_turn.max_assistant_turns bounds both"),
    VerlKey(key="algorithm.gamma", status="alias", target="algorithm.adv_estimator_kwargs.gae.gamma",
            also=("algorithm.adv_estimator_kwargs.reinforce_pp.gamma",),
            note="the discount of the estimators that have one"),
    VerlKey(key="algorithm.lam", status="alias", target="algorithm.adv_estimator_kwargs.gae.lam", note="GAE's λ"),
    VerlKey(key="algorithm.norm_adv_by_std_in_grpo", status="alias",
            target="algorithm.adv_estimator_kwargs.grpo.norm_adv_by_std_in_grpo",
            also=("algorithm.adv_estimator_kwargs.grpo_opd.norm_adv_by_std_in_grpo",)),
    VerlKey(key="algorithm.rollout_correction.bypass_mode", status="ignored", allowed=(False,),
            note="only verl's decoupled mode is built (π_old recomputed by the trainer)"),
    VerlKey(key="algorithm.rollout_correction.loss_type", status="ignored", allowed=("ppo_clip",),
            note="the correction weights algorithm.policy_loss's per-token loss"),
    VerlKey(key="algorithm.rollout_correction.rollout_is_batch_normalize", status="ignored", allowed=(False,),
            note="the weights are not normalised over the batch"),
    VerlKey(key="reward.reward_manager.name", status="ignored", allowed=("naive", "dapo"),
            note="the scoring is reward.name (math: verl's default scorer by data_source), DAPO's length penalty "
                 "reward.overlong_buffer.*"),
    VerlKey(key="reward.reward_manager.source", status="ignored", allowed=("register",),
            note="reward plugins are installed packages (reward.name)"),
    VerlKey(key="reward.custom_reward_function.path", status="ignored", allowed=(None,),
            note="use reward.name=function reward.kwargs.path=FILE.py:FN (hybridrl's argument names: "
                 "hybridrl/rewards/function.py)"),
    VerlKey(key="reward.custom_reward_function.name", status="ignored", allowed=(None, "compute_score"),
            note="use reward.name=function reward.kwargs.path=FILE.py:FN"),
    VerlKey(key="reward.reward_model.enable", status="ignored", allowed=(False,),
            note="a reward model scores with reward.name=model reward.kwargs.path=<HF checkpoint>"),
    VerlKey(key="rollout.nnodes", status="joint", group="placement",
            note="the engines' own ranks: rollout.num_ranks = rollout.nnodes × rollout.n_gpus_per_node, "
                 "placement=disaggregated, trainer.n_gpus_per_node counting both"),
    VerlKey(key="rollout.n_gpus_per_node", status="joint", group="placement", note="as rollout.nnodes"),
    VerlKey(key="distillation.enabled", status="joint", group="distillation",
            note=f"a teacher ({AOR}.teacher) and its distillation: a supervised loss term ({AOR}.teacher.loss, "
                 "verl's use_policy_gradient=false) or the reverse-KL advantage (algorithm.adv_estimator=opd / "
                 "grpo_opd, use_policy_gradient=true)"),
    VerlKey(key=f"{_TEACHER}.model_path", status="joint", group="distillation", note=f"{AOR}.teacher.model.path"),
    VerlKey(key="distillation.distillation_loss.loss_mode", status="joint", group="distillation",
            note=f"use_policy_gradient=false: {AOR}.teacher.loss.loss_mode (forward_kl_topk, k1/kl, k2/mse, "
                 "k3/low_var_kl, abs); use_policy_gradient=true: k1 only, the reverse KL as the (negated) advantage "
                 "(algorithm.adv_estimator=opd; grpo_opd with use_task_rewards=true); forward_kl_topk_tail is not "
                 "built"),
    VerlKey(key="distillation.distillation_loss.use_policy_gradient", status="joint", group="distillation",
            note=f"false: a supervised loss term ({AOR}.teacher.loss); true: a policy-gradient advantage (opd, "
                 "grpo_opd)"),
    VerlKey(key="distillation.distillation_loss.use_task_rewards", status="joint", group="distillation",
            note=f"supervised: {AOR}.teacher.loss.use_task_rewards (false: no policy-gradient term); policy "
                 "gradient: true is GRPO's task advantage plus the distillation one (grpo_opd), false the "
                 "distillation one alone (opd)"),
    VerlKey(key="distillation.distillation_loss.distillation_loss_coef", status="joint", group="distillation",
            note=f"{AOR}.teacher.loss.distillation_loss_coef, or algorithm.adv_estimator_kwargs.distill_coef (policy "
                 "gradient with use_task_rewards)"),
    VerlKey(key="distillation.distillation_loss.topk", status="joint", group="distillation",
            note=f"{AOR}.teacher.loss.topk (forward_kl_topk)"),
    VerlKey(key="distillation.distillation_loss.loss_max_clamp", status="joint", group="distillation",
            note=f"{AOR}.teacher.loss.loss_max_clamp (supervised); the distillation advantage is not clamped"),
    VerlKey(key="distillation.distillation_loss.log_prob_min_clamp", status="joint", group="distillation",
            note=f"{AOR}.teacher.loss.log_prob_min_clamp (forward_kl_topk)"),
    VerlKey(key="distillation.distillation_loss.policy_loss_mode", status="ignored", allowed=("vanilla",),
            note="the distillation advantage goes through algorithm.policy_loss with the actor's clip ratios"),
    *[VerlKey(key=f"distillation.distillation_loss.{k}", status="ignored", allowed=(0.2,),
              note="the actor's clip ratios (actor_rollout_ref.actor.clip_ratio*) apply")
      for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")],
    *[VerlKey(key=f"distillation.{k}", status="joint", group="distillation", note=_TEACHER_ENGINE)
      for k in ("n_gpus_per_node", "nnodes")],
    *[VerlKey(key=f"{_TEACHER}.inference.{k}", status="joint", group="distillation",
              note=f"{AOR}.teacher.inference.{k}" + (" (default: the rollout's engine)" if k == "name" else ""))
      for k in ("name", "tensor_model_parallel_size", "gpu_memory_utilization")],
    VerlKey(key=f"{_TEACHER}.inference.*", status="ignored", note="the engine's own (teacher.inference.engine_kwargs)"),
    VerlKey(key=f"{_TEACHER}.num_replicas", status="ignored", note="one teacher engine per inference TP group"),
    VerlKey(key=f"{_TEACHER}.key", status="ignored", allowed=(None,), note="one teacher for every sample"),
    VerlKey(key="distillation.teacher_key", status="ignored", note="one teacher for every sample"),
    VerlKey(key="distillation.teacher_models.*", status="refused",
            note=f"one teacher: {_TEACHER}.model_path ({AOR}.teacher.model.path)"),
    *[VerlKey(key=f"{role}.megatron.{name}", status="ignored", note=note)  # the actor's, the ref's, the critic's
      for name, note in (("use_mbridge", _MCORE_ONLY), ("vanilla_mbridge", _MCORE_ONLY),
                         ("seed", "Megatron's RNG is seeded from trainer.seed"))
      for role in (f"{AOR}.actor", f"{AOR}.ref", "critic")],
    VerlKey(key=f"{AOR}.model.trust_remote_code", status="ignored", allowed=(False,),
            note="hybridrl reads the architectures it converts (Qwen2/Qwen3, Llama, their MoE, Mixtral, GLM-4.5, "
                 "DeepSeek-V3) without remote code"),
    VerlKey(key=f"{AOR}.ref.megatron.dist_checkpointing_path", status="refused",
            note="the ref starts from the HF checkpoint at actor_rollout_ref.model.path"),
    VerlKey(key="critic.model.use_remove_padding", status="alias", target="critic.megatron.use_remove_padding"),
    VerlKey(key="critic.model.enable_gradient_checkpointing", status="ignored",
            note=f"the critic recomputes as the actor does ({AOR}.model.enable_gradient_checkpointing, "
                 "override_transformer_config)"),
    VerlKey(key="data.custom_cls.path", status="ignored", allowed=(None,),
            note="rows are read from parquet/jsonl with a prompt column (data.prompt_key) and ground_truth "
                 "(hybridrl prepare writes them; docs/tasks.md)"),
    VerlKey(key="data.custom_cls.name", status="ignored", allowed=(None,), note="as data.custom_cls.path"),
    VerlKey(key="data.apply_chat_template_kwargs.*", status="refused",
            note="prompts are rendered with the tokenizer's chat template and its defaults"),
]


_OTHER = [
    VerlKey(key="algorithm.adv_estimator", status="same",
            values={"reinforce_plus_plus": "reinforce_pp", "reinforce_plus_plus_baseline": "reinforce_pp_baseline"},
            note="advantage estimator plugin (grpo, gae, rloo, reinforce_pp, opd, ...)"),
    *[VerlKey(key=f"{AOR}.actor.{k}", status="alias", target=f"algorithm.policy_loss_kwargs.{k}",
              note="the policy loss plugin's key" + (" (sapo's gate temperature)" if k.startswith("tau") else ""))
      for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "tau_pos", "tau_neg")],
    VerlKey(key=f"{AOR}.actor.clip_ratio_c", status="alias", target="algorithm.policy_loss_kwargs.clip_ratio_c",
            implies=("algorithm.policy_loss=dual_clip",),
            note="verl's loss is dual-clip PPO: algorithm.policy_loss=dual_clip comes with it unless the command "
                 "line picks a loss"),
    VerlKey(key="reward_model.overlong_buffer.enable", status="alias", target="reward.overlong_buffer.enable"),
    VerlKey(key="reward_model.overlong_buffer.len", status="alias", target="reward.overlong_buffer.len"),
    VerlKey(key="reward_model.overlong_buffer.penalty_factor", status="alias",
            target="reward.overlong_buffer.penalty_factor"),
    VerlKey(key="trainer.max_actor_ckpt_to_keep", status="alias", target="trainer.max_checkpoints_to_keep",
            values={"None": "0"}, note="actor and critic are saved together; verl's null (keep all) is 0"),
    VerlKey(key="trainer.resume_mode", status="alias", target="trainer.resume", values={"disable": "never"},
            note="auto | never | a checkpoint directory; verl's disable is never"),
    VerlKey(key="trainer.default_local_dir", status="alias", target="trainer.output_dir",
            note="checkpoints go to <output_dir>/checkpoints/step_<k>"),
    VerlKey(key=f"{AOR}.rollout.enforce_eager", status="engine",
            engines={"vllm": "enforce_eager", "sglang": "disable_cuda_graph"}),
    VerlKey(key=f"{AOR}.rollout.free_cache_engine", status="engine", engines={"sglang": "free_cache_engine"},
            note="vLLM's sleep mode frees the cache for the train phase on GPU by itself"),
    VerlKey(key=f"{AOR}.rollout.max_num_seqs", status="engine",
            engines={"vllm": "max_num_seqs", "sglang": "max_running_requests"}),
    VerlKey(key=f"{AOR}.rollout.enable_prefix_caching", status="engine", engines={"vllm": "enable_prefix_caching"}),
    VerlKey(key=f"{AOR}.rollout.dtype", status="engine", engines={"vllm": "dtype", "sglang": "dtype", "hf": "dtype"}),
    VerlKey(key=f"{AOR}.rollout.max_model_len", status="engine", engines={"vllm": "max_model_len"}),
    VerlKey(key=f"{AOR}.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache", status="engine",
            engines={"vllm": "disable_mm_preprocessor_cache"}),
    VerlKey(key=f"{AOR}.model.use_fused_kernels", status="alias", target=f"{AOR}.actor.megatron.use_fused_kernels",
            note="hybridrl's fused log-prob/entropy kernels"),
    VerlKey(key=f"{AOR}.nccl_timeout", status="alias", target="trainer.dist_timeout_s",
            note="every process group's timeout, seconds"),
    *_REWARD_KWARGS,
    VerlKey(key=f"{AOR}.rollout.calculate_log_probs", status="ignored",
            note="every engine returns the sampled tokens' log-probs (rollout/logprob_abs_diff, rollout correction)"),
    VerlKey(key=f"{AOR}.model.use_remove_padding", status="alias", target=f"{AOR}.actor.megatron.use_remove_padding"),
    VerlKey(key=f"{AOR}.actor.use_torch_compile", status="ignored", note="hybridrl does not torch.compile the actor"),
    VerlKey(key=f"{AOR}.ref.use_torch_compile", status="ignored", note="hybridrl does not torch.compile the ref"),
    VerlKey(key=f"{AOR}.actor.optim.lr_warmup_steps_ratio", status="ignored", allowed=(0, 0.0),
            note="give the warmup in steps: actor_rollout_ref.actor.optim.lr_warmup_steps"),
    VerlKey(key="data.return_raw_chat", status="ignored",
            note="verl hands the chat messages to its async servers; hybridrl's engines get token ids and the "
                 "messages stay with each row (multi-turn uses them) in every mode"),
    VerlKey(key="trainer.log_val_generations", status="ignored",
            note="set trainer.rollout_data_dir to keep every step's samples"),
    VerlKey(key=f"{AOR}.rollout.load_format", status="ignored",
            note="the engines start from model.path and get the actor's weights before the first step"),
    VerlKey(key=f"{AOR}.rollout.enable_chunked_prefill", status="ignored",
            note="the engine's default; set it through actor_rollout_ref.rollout.engine_kwargs.engine_args / "
                 "server_args"),
    VerlKey(key=f"{AOR}.rollout.max_num_batched_tokens", status="ignored",
            note="the engine's default; set it through actor_rollout_ref.rollout.engine_kwargs.engine_args / "
                 "server_args"),
    VerlKey(key=f"{AOR}.actor.megatron.use_dist_checkpointing", status="ignored", allowed=(False,),
            note="hybridrl starts from the HF checkpoint at model.path (converted exactly at start); resume from "
                 "its own checkpoints with trainer.resume"),
    VerlKey(key=f"{AOR}.ref.megatron.use_dist_checkpointing", status="ignored", allowed=(False,),
            note="the ref starts from the HF checkpoint at model.path"),
    VerlKey(key=f"{AOR}.actor.megatron.dist_checkpointing_path", status="refused",
            note="hybridrl starts from the HF checkpoint at actor_rollout_ref.model.path"),
    VerlKey(key="custom_reward_function.path", status="refused",
            note="use reward.name=function reward.kwargs.path=FILE.py:FN (its arguments are hybridrl's: "
                 "response, ground_truth, data_source=, extra=, prompt=; see hybridrl/rewards/function.py)"),
    VerlKey(key="custom_reward_function.name", status="refused",
            note="use reward.name=function reward.kwargs.path=FILE.py:FN"),
    VerlKey(key="reward_model.reward_manager", status="ignored", allowed=("naive", "dapo"),
            note="the scoring is reward.name (math: GSM8K/MATH answers checked with math-verify, as verl's default "
                 "scorer; function: your own), DAPO's length penalty reward.overlong_buffer.*"),
    VerlKey(key="reward_model.enable", status="refused",
            note="a reward model scores with reward.name=model reward.kwargs.path=<HF checkpoint>"),
    VerlKey(key=f"{AOR}.hybrid_engine", status="alias", target=f"{AOR}.rollout.placement",
            values={"True": "colocated", "False": "disaggregated"},
            note="False: the engines on their own ranks, rollout.num_ranks of them (verl's rollout.nnodes × "
                 "rollout.n_gpus_per_node)"),
    *_CURRENT,
]

VERL_KEYS: dict[str, VerlKey] = {k: VerlKey(key=k, status="same", note=n) for k, n in SAME}
VERL_KEYS |= {e.key: e for e in _OTHER}


def markdown_table() -> str:
    """The table of ``docs/verl.md`` (kept equal to it by a test)."""
    lines = ["| verl key | in hybridrl | |", "|---|---|---|"]
    for e in VERL_KEYS.values():
        values = f" (values: {', '.join(f'{a} → {b}' for a, b in e.values.items())})" if e.values else ""
        if e.status == "same":
            there = "same key" + values
        elif e.status == "alias":
            there = (", ".join(f"`{t}`" for t in (e.target, *e.also)) + values
                     + "".join(f", with `{i}`" for i in e.implies))
        elif e.status == "engine":
            there = ", ".join(f"{k}: `engine_kwargs.{v}`" for k, v in e.engines.items()) + "; others: no effect"
        elif e.status == "joint":
            there = f"read with the other `{e.group}` keys" + (
                f"; refused unless {' or '.join(str(a) for a in e.allowed)}" if e.allowed else "")
        else:
            there = e.status + (f" unless {' or '.join(str(a) for a in e.allowed)}" if e.allowed else "")
            if e.group == FSDP:
                there += " (FSDP: one line)"
        lines.append(f"| `{e.key}` | {there} | {e.note} |")
    return "\n".join(lines)
