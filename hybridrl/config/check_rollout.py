"""Checks of sampling, the algorithm and the rollout: plugins, async, multi-turn, expert routing."""

from __future__ import annotations

from pathlib import Path

from hybridrl.algorithms.kl import KL_KINDS
from hybridrl.algorithms.kl_controller import config_problems as kl_ctrl_problems
from hybridrl.algorithms.loss_agg import LOSS_AGG_MODES
from hybridrl.algorithms.rollout_correction import config_problems as rollout_correction_problems
from hybridrl.config.errors import Issues
from hybridrl.config.plan import AOR, Plan
from hybridrl.config.schema import ROLLOUT_MODES, RLConfig
from hybridrl.hf.arch import HFArch
from hybridrl.megatron.config import ROUTER_REPLAY_MODES
from hybridrl.registry import PluginError, Registry
from hybridrl.rollout.async_training import KEY as ASYNC_KEY
from hybridrl.rollout.async_training import config_problems as async_problems
from hybridrl.tools.config import config_problems as multi_turn_problems


def check_sampling(cfg: RLConfig, issues: Issues) -> None:
    r, key = cfg.actor_rollout_ref.rollout, f"{AOR}.rollout"
    issues.positive(f"{key}.update_weights_bucket_megabytes", r.update_weights_bucket_megabytes)
    if r.mode not in ROLLOUT_MODES:
        issues.add(f"{key}.mode", r.mode, f"valid: {', '.join(ROLLOUT_MODES)} (asynchronous, off-policy training is "
                   f"{ASYNC_KEY}.enable)")
    if not 0 < r.gpu_memory_utilization <= 1:
        issues.add(f"{key}.gpu_memory_utilization", r.gpu_memory_utilization, "must be in (0, 1]: the share of "
                   "each GPU the engine takes for weights and KV cache")
    for sub, t, p, k in (("", r.temperature, r.top_p, r.top_k),
                         (".val_kwargs", r.val_kwargs.temperature, r.val_kwargs.top_p, r.val_kwargs.top_k)):
        if t < 0:
            issues.add(f"{key}{sub}.temperature", t, "must be ≥ 0 (0 = greedy)")
        if not 0 < p <= 1:
            issues.add(f"{key}{sub}.top_p", p, "must be in (0, 1]")
        if k == 0 or k < -1:
            issues.add(f"{key}{sub}.top_k", k, "must be -1 (off) or ≥ 1")
    issues.positive(f"{key}.val_kwargs.n", r.val_kwargs.n)
    if r.val_kwargs.n > 1 and r.val_kwargs.sampling_temperature == 0:
        issues.add(f"{key}.val_kwargs.n", r.val_kwargs.n, "several greedy samples of a prompt are identical: set "
                   f"{key}.val_kwargs.do_sample=true and {key}.val_kwargs.temperature > 0 (e.g. 0.6 or 1.0) for "
                   "mean@k/pass@k, or n=1")


def check_algorithm(cfg: RLConfig, issues: Issues) -> None:
    a, alg = cfg.actor_rollout_ref.actor, cfg.algorithm
    if a.loss_agg_mode not in LOSS_AGG_MODES:
        issues.add(f"{AOR}.actor.loss_agg_mode", a.loss_agg_mode, f"valid: {', '.join(LOSS_AGG_MODES)}")
    if a.kl_loss_type not in KL_KINDS:
        issues.add(f"{AOR}.actor.kl_loss_type", a.kl_loss_type, f"valid: {', '.join(KL_KINDS)}")
    if alg.kl_penalty not in KL_KINDS:
        issues.add("algorithm.kl_penalty", alg.kl_penalty, f"valid: {', '.join(KL_KINDS)}")
    if a.kl_loss_coef < 0:
        issues.add(f"{AOR}.actor.kl_loss_coef", a.kl_loss_coef, "must be ≥ 0")
    for key, value, message in kl_ctrl_problems(alg.kl_ctrl):
        issues.add(key, value, message)
    if alg.kl_ctrl.type != "fixed" and not alg.use_kl_in_reward:
        issues.add("algorithm.kl_ctrl.type", alg.kl_ctrl.type,
                   "controls the KL-in-reward coefficient: set algorithm.use_kl_in_reward=true, or type=fixed")
    if cfg.actor_rollout_ref.ref.enable is False:
        kl_terms = ((f"{AOR}.actor.use_kl_loss", a.use_kl_loss), ("algorithm.use_kl_in_reward", alg.use_kl_in_reward))
        for key, on in kl_terms:
            if on:
                issues.add(key, True, f"a KL term needs the reference model, but {AOR}.ref.enable=false; "
                                      f"enable the ref (or leave it null) or turn the KL term off")


def check_rollout_correction(cfg: RLConfig, issues: Issues) -> None:
    # every engine reports the log-prob of each sampled token (``Generation.logprobs`` is part of the
    # RolloutEngine contract, and the batch builder rejects a missing one), so no engine capability is checked
    for key, value, message in rollout_correction_problems(cfg.algorithm.rollout_correction):
        issues.add(key, value, message)


def check_async(cfg: RLConfig, world: int, issues: Issues) -> None:
    r, a, alg = cfg.actor_rollout_ref.rollout, cfg.async_training, cfg.algorithm
    try:
        loss = Registry("policy_losses").load(alg.policy_loss, key="algorithm.policy_loss")
    except PluginError:  # reported by check_plugins
        loss = None
    correction = alg.rollout_correction
    problems = async_problems(a, placement=r.placement, num_ranks=r.num_ranks, world_size=world,
                              rollout_tp=max(r.tensor_model_parallel_size, 1),
                              correction_on=correction.rollout_is is not None or correction.rollout_rs is not None,
                              policy_loss=alg.policy_loss, loss_is_clipped=getattr(loss, "trust_region", False))
    for key, value, message in problems:
        issues.add(key, value, message)
    if problems or not a.enable:
        return
    if a.partial_rollout:
        engine = engine_class(r.name)
        if engine is not None and not getattr(engine, "supports_abort", False):
            issues.add(f"{AOR}.rollout.name", r.name, f"cannot interrupt its generations (no abort/resume), which "
                       f"{ASYNC_KEY}.partial_rollout=true needs: use hf, sglang or vllm, or set partial_rollout=false")


def engine_class(name: str) -> object | None:
    """The rollout engine plugin ``name`` (its class, for its capabilities), or None when it does not load (which
    :func:`check_plugins` reports)."""
    try:
        return Registry("rollout_engines").load(name, key=f"{AOR}.rollout.name")
    except PluginError:
        return None


def check_shared_prompt_model(cfg: RLConfig, model: HFArch | None, issues: Issues) -> None:
    """Shared-prompt rows give each response the positions after its prompt through the model's one rotary table
    (:mod:`hybridrl.megatron.rope_positions`); multi-latent attention keeps a rotary table per layer."""
    if cfg.actor_rollout_ref.actor.use_prefix_grouper and model is not None and model.mla is not None:
        issues.add(f"{AOR}.actor.use_prefix_grouper", True, f"not supported with multi-latent attention "
                   f"(model_type={model.family!r}: its positions are applied per layer); set it to false")


def check_expert_parallel_batches(cfg: RLConfig, issues: Issues) -> None:
    """At EP > 1 the EP ranks exchange tokens in every MoE layer of every micro-batch, so they need the same number
    of micro-batches, each of one shape: the runner pads fixed and token-budget micro-batches to that (the longest
    over the EP group; :mod:`hybridrl.megatron.dynamic_batch` agrees on the count); shared-prompt rows (a shape per
    rank) are refused."""
    aor = cfg.actor_rollout_ref
    ep = aor.actor.megatron.expert_model_parallel_size
    if ep > 1 and aor.actor.use_prefix_grouper:
        issues.add(f"{AOR}.actor.use_prefix_grouper", True, f"not supported with {AOR}.actor.megatron."
                   f"expert_model_parallel_size={ep} (the expert-parallel ranks need micro-batches of one shape); "
                   "set it to false")


def check_router_replay(cfg: RLConfig, model: HFArch | None, issues: Issues) -> None:
    """``actor.router_replay.mode`` (:mod:`hybridrl.megatron.router_replay`): an MoE model, an engine that records
    its routing for R3, and the layouts the replay maps positions through."""
    a, r = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    key, mode = f"{AOR}.actor.router_replay.mode", a.router_replay.mode
    if mode not in ROUTER_REPLAY_MODES:
        issues.add(key, mode, f"valid: {', '.join(ROUTER_REPLAY_MODES)}")
        return
    if mode == "disabled":
        return
    if model is not None and model.moe is None:
        issues.add(key, mode, f"the model ({model.family}) is dense: it has no router to replay; use disabled")
    if mode == "R3":
        engine = engine_class(r.name)
        if engine is not None and not getattr(engine, "supports_routed_experts", False):
            issues.add(f"{AOR}.rollout.name", r.name, f"does not return the experts it routed each token to, which "
                       f"{key}=R3 replays: use hf, vllm or sglang (GPU), or R2 (the trainer's own routing at the "
                       "old-log-prob pass)")
        if r.multi_turn.enable:
            issues.add(f"{AOR}.rollout.multi_turn.enable", True, f"valid, but not built yet with {key}=R3 (an "
                       f"episode's turns would each need their routing joined); use R2, or single-turn")
    if a.use_prefix_grouper:
        issues.add(f"{AOR}.actor.use_prefix_grouper", True, f"shared-prompt rows are not supported with {key}={mode} "
                   "(a prompt's positions are shared by its samples); set it to false")
    if a.megatron.override_transformer_config.get("recompute_granularity"):
        issues.add(f"{AOR}.actor.megatron.override_transformer_config.recompute_granularity",
                   a.megatron.override_transformer_config["recompute_granularity"],
                   f"activation recompute re-runs the routers in the backward pass, which {key}={mode} does not "
                   f"replay yet; turn recompute off ({AOR}.model.enable_gradient_checkpointing=false, and no "
                   f"recompute_* in override_transformer_config)")


def check_multi_turn(cfg: RLConfig, issues: Issues) -> None:
    key = f"{AOR}.rollout.multi_turn"
    problems = multi_turn_problems(
        cfg.actor_rollout_ref.rollout.multi_turn,
        load_tool=lambda name: Registry("tools").load(name, key=f"{key}.tools"),
        environments=lambda name: Registry("environments").load(name, key=f"{key}.environment"),
        check_kwargs=lambda group, name, kwargs, kwargs_key: Registry(group).make_config(name, kwargs, key=kwargs_key))
    for k, value, message in problems:
        issues.add(k, value, message)
    if cfg.actor_rollout_ref.rollout.multi_turn.enable and not cfg.data.apply_chat_template:
        issues.add("data.apply_chat_template", False, f"{key}.enable renders every turn with the tokenizer's chat "
                   "template, the prompt too: set data.apply_chat_template=true (the rows' prompts: text or messages)")


# hybridrl.hf.fp8: the actor loads an FP8 checkpoint dequantised, but an engine on a GPU serves it as shipped
FP8_SYNC_PROBLEM = (
    f"{AOR}.model.path holds FP8 weights (config.json quantization_config), which the engine serves as shipped (e4m3 "
    "GEMMs with block scales); the trainer's weight sync streams bf16 tensors, which that engine cannot take in place "
    "(slime quantises each weight to e4m3 blocks on the fly before update_weights_from_tensor; hybridrl does not "
    "yet): point the run at a bf16 copy (DeepSeek's fp8_cast_bf16.py, without quantization_config)")


def check_plugins(cfg: RLConfig, plan: Plan, issues: Issues) -> None:
    r, alg = cfg.actor_rollout_ref.rollout, cfg.algorithm
    chosen = [
        ("rollout_engines", f"{AOR}.rollout.name", r.name, f"{AOR}.rollout.engine_kwargs", r.engine_kwargs),
        ("reward_managers", "reward.name", cfg.reward.name, "reward.kwargs", cfg.reward.kwargs),
        ("advantage_estimators", "algorithm.adv_estimator", alg.adv_estimator,
         "algorithm.adv_estimator_kwargs", alg.adv_estimator_kwargs),
        ("policy_losses", "algorithm.policy_loss", alg.policy_loss,
         "algorithm.policy_loss_kwargs", alg.policy_loss_kwargs),
    ]
    for group, name_key, name, kwargs_key, kwargs in chosen:
        reg = Registry(group)
        try:
            cls = reg.load(name, key=name_key)
        except PluginError as e:
            issues.add(name_key, name, str(e).removeprefix(f"{name_key}={name!r}: "))
            continue
        try:
            config = reg.make_config(name, kwargs, key=kwargs_key)
        except PluginError as e:
            issues.add(kwargs_key, dict(kwargs), str(e))
            config = None
        notes = getattr(cls, "plan_notes", None)  # optional: what the engine says about itself on this device
        if group == "rollout_engines" and config is not None and callable(notes):
            try:
                plan.notes.extend(notes(config, device_type=plan.device_type, tp_size=plan.rollout_tp))
            except ValueError as e:
                issues.add(kwargs_key, dict(kwargs), str(e))
        model_problem = getattr(cls, "model_problem", None)  # optional: a checkpoint it can't serve here
        model_dir = Path(cfg.actor_rollout_ref.model.path)
        if group == "rollout_engines" and callable(model_problem) and (model_dir / "config.json").is_file():
            if (problem := model_problem(str(model_dir), device_type=plan.device_type)) is not None:
                issues.add(name_key, name, problem)
        fp8 = plan.model is not None and plan.model.fp8_blocks is not None and (model_dir / "config.json").is_file()
        if group == "rollout_engines" and fp8 and plan.device_type != "cpu":  # planning (--model-config): a note
            issues.add(name_key, name, FP8_SYNC_PROBLEM)
        if group == "rollout_engines" and r.tensor_model_parallel_size > 1 and not cls.supports_tensor_parallel:
            issues.add(f"{AOR}.rollout.tensor_model_parallel_size", r.tensor_model_parallel_size,
                       f"rollout engine {name!r} runs one engine per rank; use 1 (or an engine with TP, e.g. sglang)")
        if group == "advantage_estimators":
            d = cfg.actor_rollout_ref.teacher.loss
            trained = not (d.enabled and not d.use_task_rewards)  # else the distillation loss alone is trained
            if cls.needs_group and r.n < 2 and trained:
                issues.add(f"{AOR}.rollout.n", r.n,
                           f"advantage estimator {name!r} compares samples of one prompt: needs rollout.n ≥ 2")
            agg = getattr(cls, "loss_agg_mode", None)  # an estimator that is right with one aggregation only
            if agg is not None and cfg.actor_rollout_ref.actor.loss_agg_mode != agg:
                issues.add(f"{AOR}.actor.loss_agg_mode", cfg.actor_rollout_ref.actor.loss_agg_mode,
                           f"algorithm.adv_estimator={name!r} needs {AOR}.actor.loss_agg_mode={agg!r}")
            if cls.needs_critic and "critic" not in plan.roles:
                issues.add("critic.enable", cfg.critic.enable, f"algorithm.adv_estimator={name!r} needs a critic "
                           "(values): set critic.enable=true or null, or use a critic-free estimator (grpo, rloo, …)")
            if not cls.needs_critic and cfg.critic.enable:
                issues.add("critic.enable", True, f"algorithm.adv_estimator={name!r} does not use values: the critic "
                           "would train for nothing; set critic.enable=null (or false), or adv_estimator=gae")
