"""Static validation: the whole config is checked before any model or engine is built.

Each rule lives with the object that owns it — the plan (placement, batch arithmetic), the HF
checkpoint reader (architecture, how sizes split the model), Megatron's layout rules, the plugins'
``Config`` classes, the loss/KL/logger/data-format lists of the modules that implement them — and
validation collects their problems into one ``ConfigError``, each naming its key, value and what
would be valid. Reads only config files, the checkpoint's ``config.json`` and plugin classes (which
import torch, never Megatron or an engine).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from hybridrl import bootstrap
from hybridrl.algorithms.dynamic_sampling import config_problems as dynamic_sampling_problems
from hybridrl.algorithms.kl import KL_KINDS
from hybridrl.algorithms.kl_controller import config_problems as kl_ctrl_problems
from hybridrl.algorithms.loss_agg import LOSS_AGG_MODES
from hybridrl.algorithms.rollout_correction import config_problems as rollout_correction_problems
from hybridrl.config import teacher
from hybridrl.config.derived import apply_gradient_checkpointing, resolve_total_steps
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.memory import GB
from hybridrl.config.plan import AOR, Plan, RoleLayout, critic_needed, device_memory_gb
from hybridrl.config.plugin_kwargs import resolve_plugin_kwargs
from hybridrl.config.schema import DEVICES, ROLLOUT_MODES, ModelConfig, RLConfig, TrainerConfig
from hybridrl.config.sft_schema import SFTConfig, SFTTrainerConfig, target_problems
from hybridrl.data.checks import file_problems
from hybridrl.data.rows import TRUNCATIONS
from hybridrl.data.sources import VALID as VALID_DATA
from hybridrl.data.sources import is_hf, source_problem
from hybridrl.hf.arch import HFArch, inspect_model_dir
from hybridrl.lora.config import lora_problems
from hybridrl.megatron.config import (
    LR_DECAY_STYLES,
    OPTIMIZERS,
    ROUTED_EXPERTS_UPSTREAM,
    ROUTER_REPLAY_MODES,
    MegatronConfig,
    OptimConfig,
    interleaved_micro_batches_problem,
    layout_problems,
)
from hybridrl.megatron.transformer_overrides import megatron_config_problems
from hybridrl.registry import PluginError, Registry
from hybridrl.rewards.execution import config_problems as reward_config_problems
from hybridrl.rewards.overlong import config_problems as overlong_problems
from hybridrl.rollout.async_training import KEY as ASYNC_KEY
from hybridrl.rollout.async_training import config_problems as async_problems
from hybridrl.run_lock import output_dir_problem
from hybridrl.tools.config import config_problems as multi_turn_problems
from hybridrl.tracking import LOGGERS, missing_logger_packages


class _Issues(list[ConfigIssue]):
    def add(self, key: str, value: object, message: str) -> None:
        self.append(ConfigIssue(key=key, value=value, message=message))

    def positive(self, key: str, value: int | float) -> None:
        if value < 1:
            self.add(key, value, "must be ≥ 1")


def device_type(device: str, *, planning: bool = False) -> str:
    """``trainer.device`` resolved: ``auto`` is cuda where a GPU is visible (or when planning a run for
    another machine), else cpu."""
    if device != "auto":
        return device
    if planning:
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def validate(cfg: RLConfig, *, world_size: int | None = None, before_bootstrap: bool = False,
             model_config: Path | None = None, ranks_per_node: int | None = None) -> Plan:
    """Check ``cfg`` for a run on ``world_size`` ranks; return its plan or raise ConfigError.

    ``before_bootstrap``: a model or data file that the config builds when missing
    (``build_if_missing``, inside the hybridrl cache) may not exist yet; the checks that need it wait.
    ``model_config``: plan a run on another machine: take the architecture from this config.json
    instead of the model directory, and skip every check of local files (weights, tokenizer, data).
    """
    issues = _Issues()
    t, aor = cfg.trainer, cfg.actor_rollout_ref
    steps_problem, steps_note = resolve_total_steps(cfg)  # total_epochs → total_training_steps (verl's rule)
    apply_gradient_checkpointing(cfg)
    resolve_plugin_kwargs(cfg)  # each plugin block as its chosen plugin's kwargs
    if steps_problem is not None:
        issues.add("trainer.total_epochs", t.total_epochs, steps_problem)
    world = world_size if world_size is not None else t.nnodes * t.n_gpus_per_node
    if world < 1:
        issues.add("trainer.n_gpus_per_node", t.n_gpus_per_node, "world size must be ≥ 1")
        world = 1
    planning = model_config is not None
    if planning:
        try:
            model: HFArch | None = HFArch.from_hf(model_config)
        except (OSError, KeyError, ValueError, NotImplementedError) as e:
            issues.add("--model-config", str(model_config), str(e))
            model = None
    else:
        model = _check_model(f"{AOR}.model", aor.model, issues, before_bootstrap=before_bootstrap)
    for key, value, message in lora_problems(aor.model, key=f"{AOR}.model"):
        issues.add(key, value, message)
    teacher_arch, teacher_issues = (None, []) if planning else teacher.teacher_model(
        cfg, before_bootstrap=before_bootstrap)
    for key, value, message in teacher_issues + teacher.teacher_layout_problems(cfg, teacher_arch):
        issues.add(key, value, message)
    if teacher_arch is not None and model is not None and not teacher_issues:
        for key, value, message in teacher.tokenizer_problems(cfg):
            issues.add(key, value, message)
    plan, plan_issues = Plan.build(cfg, world_size=world, model=model, ranks_per_node=ranks_per_node,
                                   teacher_model=teacher_arch,
                                   device_type=device_type(t.device, planning=planning) if t.device in DEVICES
                                   else "cpu")
    issues += plan_issues
    _check_layout(f"{AOR}.actor.megatron", aor.actor.megatron, plan.trainer_world_size, model, issues,
                  world_note=f" (the {plan.trainer_world_size} trainer ranks: the world size {world} less "
                             f"{AOR}.rollout.num_ranks={plan.num_engine_ranks})" if plan.num_engine_ranks else "")
    for key, value, message in megatron_config_problems(aor.actor.megatron.dtype,
                                                        aor.actor.megatron.override_transformer_config,
                                                        key=f"{AOR}.actor.megatron"):
        issues.add(key, value, message)
    if "ref" in plan.roles:  # one Megatron parallel_state per process: the ref runs on the actor's layout
        for size, ref_value, actor_value in aor.ref.megatron.mismatches(aor.actor.megatron):
            issues.add(f"{AOR}.ref.megatron.{size}", ref_value,
                       f"must equal {AOR}.actor.megatron.{size}={actor_value} (the ref shares the actor's Megatron "
                       "process groups); leave it null to follow the actor")
    _check_sampling(cfg, issues)
    if steps_note is not None:
        plan.notes.append(steps_note)
    steps = plan.batch.total_optimizer_steps if t.total_training_steps is not None else None
    _check_optim(f"{AOR}.actor.optim", aor.actor.optim, aor.actor.megatron, issues, optimizer_steps=steps)
    _check_algorithm(cfg, issues)
    overlong = overlong_problems(cfg.reward.overlong_buffer, max_response_length=cfg.data.max_response_length)
    sampling = dynamic_sampling_problems(cfg.algorithm.filter_groups, train_batch_size=cfg.data.train_batch_size,
                                         gen_batch_size=cfg.data.gen_batch_size, n=aor.rollout.n)
    for key, value, message in sampling + overlong:  # DAPO's two
        issues.add(key, value, message)
    _check_rollout_correction(cfg, issues)
    _check_async(cfg, world, issues)
    _check_plugins(cfg, plan, issues)
    _check_router_replay(cfg, model, issues)
    _check_expert_parallel_batches(cfg, issues)
    _check_multi_turn(cfg, issues)
    if "critic" in plan.roles:
        _check_critic(cfg, plan, model, issues, before_bootstrap=before_bootstrap or planning)
    _check_lengths(cfg.data.max_prompt_length, cfg.data.max_response_length, model, issues)
    issues.positive("data.val_batch_size", cfg.data.val_batch_size)
    if cfg.data.truncation not in TRUNCATIONS:
        issues.add("data.truncation", cfg.data.truncation, f"valid: {', '.join(TRUNCATIONS)} (used when "
                   "data.filter_overlong_prompts=false: a longer prompt is an error, or cut keeping its left/right/"
                   "middle tokens)")
    if not planning:
        _check_data(issues, "data", cfg.data.train_files, cfg.data.val_files, cfg.data.build_if_missing,
                    before_bootstrap=before_bootstrap, columns={"data.prompt_key": cfg.data.prompt_key,
                                                                "data.ground_truth_key": cfg.data.ground_truth_key})
    _check_trainer(cfg, issues, planning=planning)
    _check_timeouts(cfg, issues)
    _check_reward(cfg, issues)
    _check_memory(cfg, plan, issues)
    if not planning:
        _check_fused_kernels(cfg, plan, issues)
    if issues:
        raise ConfigError(list(issues))
    return plan


def _check_fused_kernels(cfg: RLConfig, plan: Plan, issues: _Issues) -> None:
    """``use_fused_kernels=true`` needs them on this machine: the C++ toolchain on CPU (checked without
    building: compiler, ninja, sources), Triton on CUDA. Null falls back by itself (one warning)."""
    if cfg.actor_rollout_ref.actor.megatron.use_fused_kernels is not True:
        return
    if plan.device_type == "cpu":
        from hybridrl.ops.cpp_build import build_problem

        problem = build_problem()
    else:
        problem = None if importlib.util.find_spec("triton") is not None else "triton is not installed"
    if problem is not None:
        issues.add(f"{AOR}.actor.megatron.use_fused_kernels", True,
                   f"the fused kernels cannot be used here: {problem}; set it to null (the plain path where they "
                   f"are missing) or false")


def _check_timeouts(cfg: RLConfig, issues: _Issues) -> None:
    """Every wait below the collectives' timeout: a rank waiting in a collective while its engine generates or
    its reward scores must not time out before the engine's or the reward's own, clearer, error."""
    limit, r = cfg.trainer.dist_timeout_s, cfg.actor_rollout_ref.rollout
    if limit <= 0:
        issues.add("trainer.dist_timeout_s", limit, "must be > 0")
        return
    if cfg.trainer.max_consecutive_skipped_steps < 0:
        issues.add("trainer.max_consecutive_skipped_steps", cfg.trainer.max_consecutive_skipped_steps,
                   "must be ≥ 0 (0: never stop)")
    waits = [("reward.timeout_s", cfg.reward.timeout_s)]
    for group, name, key, kwargs in (("rollout_engines", r.name, f"{AOR}.rollout.engine_kwargs", r.engine_kwargs),
                                     ("reward_managers", cfg.reward.name, "reward.kwargs", cfg.reward.kwargs)):
        try:
            plugin_cfg = Registry(group).make_config(name, kwargs, key=key)
        except PluginError:
            continue  # reported by _check_plugins
        waits += [(f"{key}.{f.name}", getattr(plugin_cfg, f.name)) for f in dataclasses.fields(plugin_cfg)
                  if f.name.endswith("_timeout_s")]
    for key, value in waits:
        if value is not None and value <= 0:
            issues.add(key, value, "must be > 0 (or null: no limit)")
        elif value is None or value >= limit:
            issues.add(key, value, f"must be below trainer.dist_timeout_s={limit} (a rank waits in a collective "
                                   f"meanwhile); lower it or raise trainer.dist_timeout_s")


def _check_reward(cfg: RLConfig, issues: _Issues) -> None:
    """``reward.on_error``, ``reward.num_workers``, the overlap flag and the worst-case wait: the runner's rules."""
    for key, value, message in reward_config_problems(cfg.reward, dist_timeout_s=cfg.trainer.dist_timeout_s):
        issues.add(key, value, message)


def _check_memory(cfg: RLConfig, plan: Plan, issues: _Issues) -> None:
    """The plan's peak per-rank memory must fit the device (GPU plans only), naming what would shrink it."""
    mem = plan.memory
    if mem is None or plan.device_type != "cuda":
        return
    capacity, r = device_memory_gb(cfg), cfg.actor_rollout_ref.rollout
    fit = mem.sequences_at_once
    share = -(-plan.batch.prompts_per_generation * plan.batch.n // max(len(plan.engines), 1))  # samples per engine
    if fit is not None and fit < 1:
        issues.add(f"{AOR}.rollout.gpu_memory_utilization", r.gpu_memory_utilization,
                   f"the engine's KV pool ({mem.engine_kv / GB:.1f} GB of its {r.gpu_memory_utilization} × "
                   f"{capacity:.0f} GB, after {mem.engine_weights / GB:.1f} GB of weights) holds no sequence of "
                   f"{cfg.data.max_prompt_length + cfg.data.max_response_length} tokens: raise it, or "
                   f"{AOR}.rollout.tensor_model_parallel_size, or lower data.max_response_length")
    elif fit is not None:
        plan.notes.append(f"each engine's KV pool holds {fit} sequences of the longest length "
                          f"({cfg.data.max_prompt_length + cfg.data.max_response_length} tokens) at once; a step gives "
                          f"it up to {share} samples" + (f" (≥ {-(-share // fit)} waves)" if share > fit else ""))
    if mem.peak <= capacity * GB:
        return
    m, a = cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.actor
    keys = [f"{AOR}.actor.megatron.tensor_model_parallel_size / pipeline_model_parallel_size (raise)"]
    keys += [f"{AOR}.actor.megatron.{k}=true" for k in ("use_distributed_optimizer", "param_offload", "grad_offload",
                                                       "optimizer_offload") if not getattr(m, k)]
    if m.dtype == "float32":
        keys.append(f"{AOR}.actor.megatron.dtype=bfloat16")
    if m.override_transformer_config.get("recompute_granularity") != "full":
        keys.append(f"+{AOR}.actor.megatron.override_transformer_config.recompute_granularity=full")
    keys.append(f"{AOR}.actor.{'ppo_max_token_len_per_gpu' if a.use_dynamic_bsz else 'ppo_micro_batch_size_per_gpu'}"
                " (lower)")
    keys.append(f"{AOR}.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} (raise: engine weights, KV)")
    if mem.pooled:
        keys.append(f"{AOR}.rollout.gpu_memory_utilization={r.gpu_memory_utilization} (lower: the engine's share)")
    issues.add("trainer.device_memory_gb", capacity,
               f"the largest rank needs ~{mem.peak / GB:.1f} GB ({mem}); to fit, change: {'; '.join(keys)}")


def _check_model(key: str, m: ModelConfig, issues: _Issues, *, before_bootstrap: bool) -> HFArch | None:
    """The checkpoint's problems; a start model that ``build_if_missing`` will build is pending."""
    if (problem := bootstrap.kind_problem(m.build_if_missing, model=True)) is not None:
        issues.add(f"{key}.build_if_missing", m.build_if_missing, problem)
    if (problem := bootstrap.outside_cache_problem(m.build_if_missing, m.path)) is not None:
        issues.add(f"{key}.path", m.path, problem)
        return None
    if before_bootstrap and bootstrap.will_build(m.build_if_missing, m.path, model=True):
        return None
    info, problems = inspect_model_dir(m.path, tokenizer_path=m.tokenizer_path)
    for p in problems:
        tok = m.tokenizer_path is not None and "tokenizer" in p
        issues.add(f"{key}.tokenizer_path" if tok else f"{key}.path", m.tokenizer_path if tok else m.path, p)
    return info


def _check_layout(key: str, m: MegatronConfig, world: int, model: HFArch | None, issues: _Issues, *,
                  world_note: str = "") -> None:
    """``world``: the ranks the layout spans (``world_note`` says why, when that is not the launched world)."""
    te = importlib.util.find_spec("transformer_engine") is not None
    for size, value, message in layout_problems(m, world_size=world, transformer_engine=te):
        issues.add(f"{key}.{size}", value, message + world_note)
    if model is not None:
        for size, value, message in model.split_problems(
                tp=max(m.tensor_model_parallel_size, 1), pp=max(m.pipeline_model_parallel_size, 1),
                vpp=m.virtual_pipeline_model_parallel_size, ep=max(m.expert_model_parallel_size, 1)):
            issues.add(f"{key}.{size}", value, message)


def _check_sampling(cfg: RLConfig, issues: _Issues) -> None:
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


def _check_optim(key: str, o: OptimConfig, m: MegatronConfig, issues: _Issues, *,
                 optimizer_steps: int | None) -> None:
    """``optimizer_steps``: the run's (None: not known yet, the warmup is checked once it is)."""
    if o.lr_warmup_steps < 0 or (o.lr_warmup_steps and optimizer_steps is not None
                                 and o.lr_warmup_steps >= optimizer_steps):
        issues.add(f"{key}.lr_warmup_steps", o.lr_warmup_steps,
                   f"must be ≥ 0 and below the run's {optimizer_steps} optimizer steps")
    if o.optimizer not in OPTIMIZERS:
        issues.add(f"{key}.optimizer", o.optimizer, f"valid: {', '.join(OPTIMIZERS)}")
    if o.lr < 0:
        issues.add(f"{key}.lr", o.lr, "must be ≥ 0")
    if o.clip_grad < 0:
        issues.add(f"{key}.clip_grad", o.clip_grad, "must be ≥ 0 (0 disables clipping)")
    if o.lr_decay_style not in LR_DECAY_STYLES:
        issues.add(f"{key}.lr_decay_style", o.lr_decay_style, f"valid: {', '.join(LR_DECAY_STYLES)}")
    if m.use_distributed_optimizer and o.optimizer != "adam":
        issues.add(f"{key}.optimizer", o.optimizer,
                   "Megatron's distributed optimizer supports adam only "
                   "(or set megatron.use_distributed_optimizer=false)")


def _check_algorithm(cfg: RLConfig, issues: _Issues) -> None:
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


def _check_rollout_correction(cfg: RLConfig, issues: _Issues) -> None:
    # every engine reports the log-prob of each sampled token (``Generation.logprobs`` is part of the
    # RolloutEngine contract, and the batch builder rejects a missing one), so no engine capability is checked
    for key, value, message in rollout_correction_problems(cfg.algorithm.rollout_correction):
        issues.add(key, value, message)


def _check_async(cfg: RLConfig, world: int, issues: _Issues) -> None:
    r, a, alg = cfg.actor_rollout_ref.rollout, cfg.async_training, cfg.algorithm
    try:
        loss = Registry("policy_losses").load(alg.policy_loss, key="algorithm.policy_loss")
    except PluginError:  # reported by _check_plugins
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
        engine = _engine_class(r.name)
        if engine is not None and not getattr(engine, "supports_abort", False):
            issues.add(f"{AOR}.rollout.name", r.name, f"cannot interrupt its generations (no abort/resume), which "
                       f"{ASYNC_KEY}.partial_rollout=true needs: use hf, sglang or vllm, or set partial_rollout=false")


def _engine_class(name: str) -> object | None:
    """The rollout engine plugin ``name`` (its class, for its capabilities), or None when it does not load (which
    :func:`_check_plugins` reports)."""
    try:
        return Registry("rollout_engines").load(name, key=f"{AOR}.rollout.name")
    except PluginError:
        return None


def _check_expert_parallel_batches(cfg: RLConfig, issues: _Issues) -> None:
    """At EP > 1 the EP ranks exchange tokens in every MoE layer of every micro-batch, so they need the same number
    of micro-batches, each of one shape (the runner pads to the longest over the EP group): token-budget
    micro-batches (a count per rank) and shared-prompt rows (a shape per rank) are refused."""
    aor = cfg.actor_rollout_ref
    ep = aor.actor.megatron.expert_model_parallel_size
    if ep <= 1:
        return
    keys = [(f"{AOR}.actor.use_dynamic_bsz", aor.actor.use_dynamic_bsz),  # the log-prob passes' null follows it
            (f"{AOR}.rollout.log_prob_use_dynamic_bsz", aor.rollout.log_prob_use_dynamic_bsz),
            (f"{AOR}.ref.log_prob_use_dynamic_bsz", aor.ref.log_prob_use_dynamic_bsz),
            ("critic.use_dynamic_bsz", cfg.critic.use_dynamic_bsz), (f"{AOR}.actor.use_prefix_grouper",
                                                                     aor.actor.use_prefix_grouper)]
    for key, value in keys:
        if value:
            issues.add(key, value, f"not supported with {AOR}.actor.megatron.expert_model_parallel_size={ep} (the "
                       "expert-parallel ranks need the same micro-batches, one shape each); set it to false")


def _check_router_replay(cfg: RLConfig, model: HFArch | None, issues: _Issues) -> None:
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
        engine = _engine_class(r.name)
        if engine is not None and not getattr(engine, "supports_routed_experts", False):
            issues.add(f"{AOR}.rollout.name", r.name, f"does not return the experts it routed each token to, which "
                       f"{key}=R3 replays: use hf, or R2 (the trainer's own routing at the old-log-prob pass)"
                       + ROUTED_EXPERTS_UPSTREAM.get(r.name, ""))
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


def _check_multi_turn(cfg: RLConfig, issues: _Issues) -> None:
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


def _check_plugins(cfg: RLConfig, plan: Plan, issues: _Issues) -> None:
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
        if group == "rollout_engines" and r.tensor_model_parallel_size > 1 and not cls.supports_tensor_parallel:
            issues.add(f"{AOR}.rollout.tensor_model_parallel_size", r.tensor_model_parallel_size,
                       f"rollout engine {name!r} runs one engine per rank; use 1 (or an engine with TP, e.g. sglang)")
        if group == "advantage_estimators":
            if cls.needs_group and r.n < 2:
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


def _check_critic(cfg: RLConfig, plan: Plan, actor_model: HFArch | None, issues: _Issues, *,
                  before_bootstrap: bool) -> None:
    """The critic's layout is the actor's (shared process groups), its start model reads the actor's tokens."""
    c, actor_megatron = cfg.critic, cfg.actor_rollout_ref.actor.megatron
    for size, critic_value, actor_value in c.megatron.mismatches(actor_megatron):
        issues.add(f"critic.megatron.{size}", critic_value,
                   f"must equal {AOR}.actor.megatron.{size}={actor_value} (the critic shares the actor's Megatron "
                   "process groups); leave it null to follow the actor")
    _check_optim("critic.optim", c.optim, actor_megatron, issues,
                 optimizer_steps=plan.batch.critic.total_optimizer_steps
                 if plan.batch.critic and cfg.trainer.total_training_steps is not None else None)
    if c.loss_agg_mode not in LOSS_AGG_MODES:
        issues.add("critic.loss_agg_mode", c.loss_agg_mode, f"valid: {', '.join(LOSS_AGG_MODES)}")
    if not c.cliprange_value > 0:
        issues.add("critic.cliprange_value", c.cliprange_value, "must be > 0 (V stays within V_old ± it)")
    if c.model.path is None or before_bootstrap:
        return
    model, problems = inspect_model_dir(c.model.path, tokenizer_path=None)
    for p in problems:
        if "holds no tokenizer" not in p:  # the critic reads the actor's token ids: its tokenizer is not used
            issues.add("critic.model.path", c.model.path, p)
    if model is not None and actor_model is not None:
        if model.vocab_size != actor_model.vocab_size:
            issues.add("critic.model.path", c.model.path, f"its vocabulary ({model.vocab_size}) must be the actor's "
                       f"({actor_model.vocab_size}): the critic reads the actor's tokens")
        for size, value, message in model.split_problems(
                tp=max(actor_megatron.tensor_model_parallel_size, 1),
                pp=max(actor_megatron.pipeline_model_parallel_size, 1),
                vpp=actor_megatron.virtual_pipeline_model_parallel_size,
                ep=max(actor_megatron.expert_model_parallel_size, 1)):
            issues.add(f"{AOR}.actor.megatron.{size}", value, f"critic.model.path: {message}")


def _check_lengths(prompt: int, response: int, model: HFArch | None, issues: _Issues) -> None:
    issues.positive("data.max_prompt_length", prompt)
    issues.positive("data.max_response_length", response)
    if model is not None and prompt + response > model.max_position_embeddings:
        issues.add("data.max_response_length", response,
                   f"data.max_prompt_length + data.max_response_length = {prompt + response} exceeds the model's "
                   f"max_position_embeddings {model.max_position_embeddings}; at most "
                   f"{model.max_position_embeddings - prompt}")


def _check_data(issues: _Issues, prefix: str, train_files: list[str], val_files: list[str], build: str | None, *,
                before_bootstrap: bool, columns: dict[str, str]) -> None:
    """Each entry's form, and each local file's own problems (:mod:`hybridrl.data.checks`: readable, has rows, has
    ``columns``); a file the run builds first is checked once it exists."""
    if (problem := bootstrap.kind_problem(build, model=False)) is not None:
        issues.add(f"{prefix}.build_if_missing", build, problem)
    if not train_files:
        issues.add(f"{prefix}.train_files", list(train_files), f"needs at least one entry: {VALID_DATA}")
    built = [train_files[0]] if train_files else []
    built += [val_files[0]] if val_files else []
    for name, files in ((f"{prefix}.train_files", train_files), (f"{prefix}.val_files", val_files)):
        for i, f in enumerate(files):
            key = f"{name}[{i}]"
            pending = before_bootstrap and f in built and bootstrap.will_build(build, f, model=False)
            if (problem := source_problem(f)) is not None:
                issues.add(key, f, problem)
            elif is_hf(f):
                if f in built and build is not None:
                    issues.add(key, f, f"a HF dataset is read, never built: set {prefix}.build_if_missing=null "
                                       f"(it is {build!r}) or name a file for it to write")
            elif f in built and (problem := bootstrap.outside_cache_problem(build, f)) is not None:
                issues.add(key, f, problem)
            elif Path(f).is_file():
                for problem in file_problems(f, columns=columns):
                    issues.add(key, f, problem)
            elif not pending:
                issues.add(key, f, "file does not exist")


def _check_trainer(cfg: RLConfig, issues: _Issues, *, planning: bool = False) -> None:
    t = cfg.trainer
    if t.total_training_steps is not None:
        issues.positive("trainer.total_training_steps", t.total_training_steps)
    issues.positive("trainer.nnodes", t.nnodes)
    issues.positive("trainer.n_gpus_per_node", t.n_gpus_per_node)
    if t.critic_warmup < 0:
        issues.add("trainer.critic_warmup", t.critic_warmup, "must be ≥ 0 (0: the actor updates from step 1)")
    elif t.critic_warmup and not critic_needed(cfg):
        issues.add("trainer.critic_warmup", t.critic_warmup, "warms up the critic, and this run has none "
                   f"(algorithm.adv_estimator={cfg.algorithm.adv_estimator!r}): set it to 0, or use gae / "
                   "critic.enable")
    _check_tracking(t, issues, planning=planning)
    last = t.total_training_steps or max(t.profile_steps, default=1)
    if bad := [s for s in t.profile_steps if not 1 <= s <= last]:
        issues.add("trainer.profile_steps", list(t.profile_steps),
                   f"step(s) {bad} outside the run: valid steps are 1..{t.total_training_steps} "
                   "(trainer.total_training_steps)")
    for key, directory in (("trainer.output_dir", t.output_dir), ("trainer.rollout_data_dir", t.rollout_data_dir)):
        if directory is not None and not planning and (problem := output_dir_problem(directory, key=key)) is not None:
            issues.add(key, directory, problem.removeprefix(f"{key}={directory!r} "))
    if t.max_checkpoints_to_keep < 0:
        issues.add("trainer.max_checkpoints_to_keep", t.max_checkpoints_to_keep, "must be ≥ 0 (0 = keep all)")
    if t.resume not in ("auto", "never") and not (Path(t.resume) / "trainer_state.pt").is_file():
        issues.add("trainer.resume", t.resume, "valid: auto, never, or a complete checkpoint dir "
                                               "(<output_dir>/checkpoints/step_<k>, holding trainer_state.pt)")
    torchrun_s = float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))  # a rank inherits torchrun's
    if t.preempt_grace_s <= 0:
        issues.add("trainer.preempt_grace_s", t.preempt_grace_s, "must be > 0 (seconds from a SIGTERM to the exit)")
    elif "TORCHELASTIC_RUN_ID" in os.environ and t.preempt_grace_s >= torchrun_s:
        issues.add("trainer.preempt_grace_s", t.preempt_grace_s,
                   f"must be below torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT ({torchrun_s:g} s: it SIGKILLs the ranks "
                   "that long after forwarding a SIGTERM); lower it or export a larger TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    if t.device not in DEVICES:
        issues.add("trainer.device", t.device, f"valid: {', '.join(DEVICES)}")
    elif t.device == "cuda" and not planning and device_type("auto") != "cuda":
        issues.add("trainer.device", t.device, "no CUDA device is visible; use cpu or auto")


def _check_tracking(t: TrainerConfig | SFTTrainerConfig, issues: _Issues, *, planning: bool = False) -> None:
    """Known logger names; and, unless planning a run for another machine, their packages installed here."""
    if t.test_freq < 0:
        issues.add("trainer.test_freq", t.test_freq, "must be ≥ 0 (0 = never)")
    bad = [lg for lg in t.logger if lg not in LOGGERS]
    if bad:
        issues.add("trainer.logger", list(t.logger), f"unknown logger(s) {bad}; valid: {', '.join(LOGGERS)}")
    for name, install in ({} if planning else missing_logger_packages(t.logger)).items():
        issues.add("trainer.logger", list(t.logger), f"logger {name!r}: {install} (or drop it from the list)")


def validate_sft(cfg: SFTConfig, *, world_size: int | None = None, before_bootstrap: bool = False) -> RoleLayout:
    """Static checks of an SFT run (the subset of ``validate`` that applies); returns its layout."""
    issues = _Issues()
    world = world_size if world_size is not None else cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    model = _check_model("model", cfg.model, issues, before_bootstrap=before_bootstrap)
    for key, value, message in lora_problems(cfg.model, key="model"):
        issues.add(key, value, message)
    _check_layout("megatron", cfg.megatron, world, model, issues)
    for key, value, message in megatron_config_problems(cfg.megatron.dtype, cfg.megatron.override_transformer_config,
                                                        key="megatron"):
        issues.add(key, value, message)
    layout = RoleLayout.of(cfg.megatron, world)
    _check_optim("optim", cfg.optim, cfg.megatron, issues, optimizer_steps=cfg.trainer.total_training_steps)
    d = cfg.data
    issues.positive("data.train_batch_size", d.train_batch_size)
    issues.positive("data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu)
    if min(d.train_batch_size, d.micro_batch_size_per_gpu) >= 1:
        n_micro, rest = divmod(d.train_batch_size, d.micro_batch_size_per_gpu * layout.dp)
        if rest:
            issues.add("data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu,
                       f"data.train_batch_size={d.train_batch_size} must split into micro-batches of this size on "
                       f"each of DP={layout.dp} ranks")
        elif layout.vpp and n_micro % layout.pp:
            issues.add("data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu,
                       interleaved_micro_batches_problem(layout.pp, layout.vpp) + f", got {n_micro}")
    _check_lengths(d.max_prompt_length, d.max_response_length, model, issues)
    _check_data(issues, "data", d.train_files, d.val_files, d.build_if_missing, before_bootstrap=before_bootstrap,
                columns={"data.prompt_key": d.prompt_key})
    issues.positive("trainer.total_training_steps", cfg.trainer.total_training_steps)
    for key, value, message in target_problems(cfg.trainer, val_files=d.val_files):
        issues.add(key, value, message)
    _check_tracking(cfg.trainer, issues)
    if issues:
        raise ConfigError(list(issues))
    return layout


def world_from_env() -> tuple[int, int | None]:
    """``(world size, ranks per node)`` of this torchrun launch (1 and None outside torchrun)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(os.environ.get("WORLD_SIZE", "1")), int(local) if local else None
