"""verl's config keys and what each is in hybridrl: the table behind ``docs/verl.md`` and the command-line check.

A verl launch script's overrides run here unchanged. Each key verl's Megatron GRPO/PPO/DAPO examples set is one of:

- ``same``: a hybridrl key of the same name and meaning (the schema has it; most keys are this);
- ``alias``: hybridrl spells it differently (``target``); the override is rewritten to the hybridrl key, with a
  notice. Only on the command line: a recipe uses the hybridrl name, so the two can never disagree in one file;
- ``engine``: a rollout-engine knob verl sets at ``actor_rollout_ref.rollout``: it goes into
  ``actor_rollout_ref.rollout.engine_kwargs`` under the chosen engine's own name for it (``engines``), and has no
  effect on an engine without one (a notice says so);
- ``ignored``: accepted, no effect here (``note`` says why), with a notice;
- ``refused``: cannot mean the same here; an error names what to use.

``tests/config/test_verl_keys.py`` keeps this table, the schema and ``docs/verl.md`` in agreement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

AOR = "actor_rollout_ref"


@dataclass(frozen=True, slots=True, kw_only=True)
class VerlKey:
    key: str  # verl's dotted key
    status: str  # one of STATUSES
    target: str | None = None  # alias: the hybridrl key
    engines: dict[str, str] = field(default_factory=dict)  # engine: rollout engine name → its engine_kwargs key
    values: dict[str, str] = field(default_factory=dict)  # alias: verl's value → hybridrl's (others pass unchanged)
    allowed: tuple[object, ...] = ()  # ignored: the values accepted (others are refused with the note); (): any
    # alias: overrides it brings along, each unless the command line sets that key itself
    implies: tuple[str, ...] = ()
    note: str = ""

    def notice(self, engine: str | None = None) -> str:
        if self.status == "alias":
            return f"verl's {self.key} is hybridrl's {self.target}" + (f" ({self.note})" if self.note else "")
        if self.status == "engine":
            where = self.engines.get(engine or "")
            if where is None:
                return (f"verl's {self.key} has no effect with rollout engine {engine!r} (it is "
                        + ", ".join(f"{k}'s {v}" for k, v in self.engines.items()) + ")")
            return f"verl's {self.key} is {AOR}.rollout.engine_kwargs.{where} for engine {engine!r}"
        return f"verl's {self.key} has no effect in hybridrl: {self.note}"

    def refuses(self, value: object) -> bool:
        """An ``ignored`` key set to a value that would change the run (``allowed`` names the harmless ones)."""
        if not self.allowed:
            return False
        return not any(value == a and type(value) is type(a) or (isinstance(a, str) and str(value) == a)
                       for a in self.allowed)


STATUSES = ("same", "alias", "engine", "ignored", "refused")

_SAME = [  # (key, note): verl's meaning, hybridrl's name
    ("algorithm.adv_estimator", "advantage estimator plugin (grpo, gae, rloo, reinforce_plus_plus, ...)"),
    ("algorithm.use_kl_in_reward", "KL penalty in the token rewards"),
    ("algorithm.kl_penalty", "estimator of the in-reward KL"),
    ("algorithm.kl_ctrl.type", "fixed | adaptive β"),
    ("algorithm.kl_ctrl.kl_coef", "β"),
    ("algorithm.kl_ctrl.target_kl", "adaptive β's target"),
    ("algorithm.kl_ctrl.horizon", "adaptive β's horizon"),
    ("algorithm.filter_groups.enable", "DAPO dynamic sampling"),
    ("algorithm.filter_groups.metric", "the group metric whose spread keeps a group"),
    ("algorithm.filter_groups.max_num_gen_batches", "generation rounds per step at most (0: no limit)"),
    ("data.train_files", "parquet/jsonl files (or hf://)"),
    ("data.val_files", "held-out files"),
    ("data.prompt_key", "the prompt column"),
    ("data.train_batch_size", "prompts per step"),
    ("data.gen_batch_size", "prompts per generation round under filter_groups"),
    ("data.val_batch_size", "prompts per evaluation batch"),
    ("data.max_prompt_length", "tokens"),
    ("data.max_response_length", "tokens generated at most"),
    ("data.filter_overlong_prompts", "drop prompts over max_prompt_length (hybridrl's default: true)"),
    ("data.truncation", "error | left | right | middle, when not filtered"),
    ("data.shuffle", "shuffle the prompts each epoch"),
    (f"{AOR}.model.path", "HF checkpoint directory"),
    (f"{AOR}.model.enable_gradient_checkpointing", "Megatron full recompute, uniform, 1 layer"),
    (f"{AOR}.model.lora_rank", "LoRA rank (0: off)"),
    (f"{AOR}.model.lora_alpha", "LoRA α"),
    (f"{AOR}.model.target_modules", "LoRA targets"),
    (f"{AOR}.actor.optim.lr", "learning rate"),
    (f"{AOR}.actor.optim.weight_decay", "AdamW weight decay"),
    (f"{AOR}.actor.optim.clip_grad", "max global grad norm"),
    (f"{AOR}.actor.optim.lr_warmup_steps", "linear warmup steps (≤ 0: none, as verl's default ratio 0)"),
    (f"{AOR}.actor.optim.lr_decay_style", "constant | linear | cosine | ..."),
    (f"{AOR}.actor.megatron.dtype", "bfloat16 | float16 | float32 (hybridrl's default: float32, for CPU runs)"),
    (f"{AOR}.actor.ppo_mini_batch_size", "prompts per optimizer step"),
    (f"{AOR}.actor.ppo_micro_batch_size_per_gpu", "samples per forward/backward"),
    (f"{AOR}.actor.use_dynamic_bsz", "token-budget micro-batches"),
    (f"{AOR}.actor.ppo_max_token_len_per_gpu", "their token budget"),
    (f"{AOR}.actor.ppo_epochs", "epochs over a step's samples"),
    (f"{AOR}.actor.shuffle", "shuffle between epochs"),
    (f"{AOR}.actor.loss_agg_mode", "token-mean | seq-mean-token-sum | seq-mean-token-mean | ..."),
    (f"{AOR}.actor.entropy_coeff", "entropy bonus"),
    (f"{AOR}.actor.use_kl_loss", "KL(actor‖ref) loss term"),
    (f"{AOR}.actor.kl_loss_coef", "its coefficient"),
    (f"{AOR}.actor.kl_loss_type", "low_var_kl | k1 | k2 | k3 | ..."),
    (f"{AOR}.actor.megatron.tensor_model_parallel_size", "TP"),
    (f"{AOR}.actor.megatron.expert_model_parallel_size", "EP: MoE experts split over the data-parallel ranks"),
    (f"{AOR}.actor.megatron.expert_tensor_parallel_size",
     "ETP: each expert's TP (null: the model's TP); below TP, EP spans the TP ranks too"),
    (f"{AOR}.actor.megatron.pipeline_model_parallel_size", "PP"),
    (f"{AOR}.actor.megatron.virtual_pipeline_model_parallel_size", "VPP"),
    (f"{AOR}.actor.megatron.context_parallel_size", "CP"),
    (f"{AOR}.actor.megatron.sequence_parallel", "sequence parallelism (with TP)"),
    (f"{AOR}.actor.megatron.use_distributed_optimizer", "ZeRO-1 optimizer over DP"),
    (f"{AOR}.actor.megatron.param_offload", "params to host while generating"),
    (f"{AOR}.actor.megatron.grad_offload", "grads to host while generating"),
    (f"{AOR}.actor.megatron.optimizer_offload", "optimizer state to host while generating"),
    (f"{AOR}.actor.megatron.override_transformer_config", "TransformerConfig fields verbatim"),
    (f"{AOR}.actor.router_replay.mode", "MoE router replay: disabled, R2 or R3 (R3: the hf engine's routing)"),
    (f"{AOR}.ref.log_prob_micro_batch_size_per_gpu", "ref pass micro-batch"),
    (f"{AOR}.ref.log_prob_use_dynamic_bsz", "ref pass token budget on"),
    (f"{AOR}.ref.log_prob_max_token_len_per_gpu", "ref pass token budget"),
    (f"{AOR}.ref.megatron.tensor_model_parallel_size", "must equal the actor's (hybridrl: null follows it)"),
    (f"{AOR}.ref.megatron.pipeline_model_parallel_size", "must equal the actor's"),
    (f"{AOR}.ref.megatron.virtual_pipeline_model_parallel_size", "must equal the actor's"),
    (f"{AOR}.ref.megatron.context_parallel_size", "must equal the actor's"),
    (f"{AOR}.ref.megatron.expert_model_parallel_size", "must equal the actor's"),
    (f"{AOR}.ref.megatron.expert_tensor_parallel_size", "must equal the actor's"),
    (f"{AOR}.ref.megatron.param_offload", "ref params to host between its passes"),
    (f"{AOR}.rollout.name", "hf | sglang | vllm (engine plugins)"),
    (f"{AOR}.rollout.mode", "sync | async (verl's agent-loop servers: the same on-policy step here)"),
    (f"{AOR}.rollout.n", "samples per prompt"),
    (f"{AOR}.rollout.tensor_model_parallel_size", "ranks per engine"),
    (f"{AOR}.rollout.gpu_memory_utilization", "engine share of each GPU (vLLM's; SGLang's mem_fraction_static)"),
    (f"{AOR}.rollout.temperature", "sampling temperature"),
    (f"{AOR}.rollout.top_p", "nucleus"),
    (f"{AOR}.rollout.top_k", "-1: off"),
    (f"{AOR}.rollout.log_prob_micro_batch_size_per_gpu", "old log-prob pass micro-batch"),
    (f"{AOR}.rollout.log_prob_use_dynamic_bsz", "its token budget on"),
    (f"{AOR}.rollout.log_prob_max_token_len_per_gpu", "its token budget"),
    (f"{AOR}.rollout.update_weights_bucket_megabytes", "weight-sync bucket size"),
    (f"{AOR}.rollout.val_kwargs.temperature", "evaluation sampling"),
    (f"{AOR}.rollout.val_kwargs.top_p", "evaluation sampling"),
    (f"{AOR}.rollout.val_kwargs.top_k", "evaluation sampling"),
    (f"{AOR}.rollout.val_kwargs.n", "samples per test prompt"),
    (f"{AOR}.rollout.val_kwargs.do_sample", "false: greedy, whatever val_kwargs.temperature says"),
    (f"{AOR}.rollout.multi_turn.enable", "tool-calling multi-turn rollouts"),
    (f"{AOR}.rollout.multi_turn.max_assistant_turns", "assistant turns per episode at most"),
    ("critic.optim.lr", "critic learning rate"),
    ("critic.ppo_micro_batch_size_per_gpu", "critic micro-batch"),
    ("critic.ppo_mini_batch_size", "critic mini-batch (prompts)"),
    ("critic.ppo_epochs", "critic epochs"),
    ("critic.cliprange_value", "value clip ε"),
    ("critic.model.path", "critic start checkpoint"),
    ("critic.megatron.tensor_model_parallel_size", "must equal the actor's (hybridrl: null follows it)"),
    ("critic.megatron.pipeline_model_parallel_size", "must equal the actor's"),
    ("critic.use_dynamic_bsz", "critic token-budget micro-batches"),
    ("critic.ppo_max_token_len_per_gpu", "their budget"),
    ("trainer.total_epochs", "passes over data.train_files (when total_training_steps is null)"),
    ("trainer.total_training_steps", "steps; overrides total_epochs"),
    ("trainer.critic_warmup", "the actor updates from this step on"),
    ("trainer.logger", "console | jsonl | wandb | tensorboard | mlflow"),
    ("trainer.project_name", "tracker project"),
    ("trainer.experiment_name", "tracker run name"),
    ("trainer.nnodes", "nodes"),
    ("trainer.n_gpus_per_node", "ranks per node"),
    ("trainer.save_freq", "checkpoint every N steps and at the end (≤ 0: never)"),
    ("trainer.test_freq", "evaluate every N steps"),
    ("trainer.val_before_train", "evaluate at step 0"),
    ("trainer.device", "cuda | cpu"),
    ("trainer.rollout_data_dir", "dump each step's samples"),
]

_OTHER = [
    VerlKey(key=f"{AOR}.actor.clip_ratio", status="alias", target="algorithm.policy_loss_kwargs.clip_ratio",
            note="the policy loss plugin's key"),
    VerlKey(key=f"{AOR}.actor.clip_ratio_low", status="alias", target="algorithm.policy_loss_kwargs.clip_ratio_low",
            note="the policy loss plugin's key"),
    VerlKey(key=f"{AOR}.actor.clip_ratio_high", status="alias", target="algorithm.policy_loss_kwargs.clip_ratio_high",
            note="the policy loss plugin's key"),
    VerlKey(key=f"{AOR}.actor.clip_ratio_c", status="alias", target="algorithm.policy_loss_kwargs.clip_ratio_c",
            implies=("algorithm.policy_loss=dual_clip",),
            note="verl's loss is dual-clip PPO: algorithm.policy_loss=dual_clip comes with it unless the command "
                 "line picks a loss"),
    VerlKey(key="reward_model.overlong_buffer.enable", status="alias", target="reward.overlong_buffer.enable"),
    VerlKey(key="reward_model.overlong_buffer.len", status="alias", target="reward.overlong_buffer.len"),
    VerlKey(key="reward_model.overlong_buffer.penalty_factor", status="alias",
            target="reward.overlong_buffer.penalty_factor"),
    VerlKey(key="trainer.max_actor_ckpt_to_keep", status="alias", target="trainer.max_checkpoints_to_keep",
            note="actor and critic are saved together"),
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
    VerlKey(key=f"{AOR}.model.use_fused_kernels", status="alias", target=f"{AOR}.actor.megatron.use_fused_kernels",
            note="hybridrl's fused log-prob/entropy kernels"),
    VerlKey(key=f"{AOR}.nccl_timeout", status="alias", target="trainer.dist_timeout_s",
            note="every process group's timeout, seconds"),
    VerlKey(key="reward_model.reward_kwargs.overlong_buffer_cfg.enable", status="alias",
            target="reward.overlong_buffer.enable"),
    VerlKey(key="reward_model.reward_kwargs.overlong_buffer_cfg.len", status="alias",
            target="reward.overlong_buffer.len"),
    VerlKey(key="reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", status="alias",
            target="reward.overlong_buffer.penalty_factor"),
    VerlKey(key="reward_model.reward_kwargs.overlong_buffer_cfg.log", status="ignored",
            note="the overlong penalty is always logged (reward/overlong_*)"),
    VerlKey(key="reward_model.reward_kwargs.max_resp_len", status="ignored",
            note="the overlong penalty counts from data.max_response_length"),
    VerlKey(key=f"{AOR}.rollout.calculate_log_probs", status="ignored",
            note="every engine returns the sampled tokens' log-probs (rollout/logprob_abs_diff, rollout correction)"),
    VerlKey(key=f"{AOR}.model.use_remove_padding", status="ignored",
            note="micro-batches are padded only to their own longest row (use_dynamic_bsz packs by tokens)"),
    VerlKey(key=f"{AOR}.actor.use_torch_compile", status="ignored", note="hybridrl does not torch.compile the actor"),
    VerlKey(key=f"{AOR}.ref.use_torch_compile", status="ignored", note="hybridrl does not torch.compile the ref"),
    VerlKey(key=f"{AOR}.actor.megatron.use_mbridge", status="ignored",
            note="hybridrl converts HF ↔ Megatron with its own exact converters (hybridrl verify-model)"),
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
    VerlKey(key=f"{AOR}.hybrid_engine", status="ignored", note="the engines are always colocated with the trainer"),
]

VERL_KEYS: dict[str, VerlKey] = {k: VerlKey(key=k, status="same", note=n) for k, n in _SAME}
VERL_KEYS |= {e.key: e for e in _OTHER}


def markdown_table() -> str:
    """The table of ``docs/verl.md`` (kept equal to it by a test)."""
    lines = ["| verl key | in hybridrl | |", "|---|---|---|"]
    for e in VERL_KEYS.values():
        if e.status == "same":
            there = "same key"
        elif e.status == "alias":
            there = f"`{e.target}`" + (f" (values: {', '.join(f'{a} → {b}' for a, b in e.values.items())})"
                                       if e.values else "") + "".join(f", with `{i}`" for i in e.implies)
        elif e.status == "engine":
            there = ", ".join(f"{k}: `engine_kwargs.{v}`" for k, v in e.engines.items()) + "; others: no effect"
        else:
            there = e.status + (f" unless {' or '.join(str(a) for a in e.allowed)}" if e.allowed else "")
        lines.append(f"| `{e.key}` | {there} | {e.note} |")
    return "\n".join(lines)
