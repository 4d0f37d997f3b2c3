"""Checks of the models a run trains or reads and of their Megatron layout, optimizer and memory (RL and SFT)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from hybridrl import bootstrap
from hybridrl.algorithms.loss_agg import LOSS_AGG_MODES
from hybridrl.config.errors import Issues
from hybridrl.config.memory import GB
from hybridrl.config.plan import AOR, Plan, device_memory_gb
from hybridrl.config.schema import ModelConfig, RLConfig
from hybridrl.hf.arch import HFArch, inspect_model_dir
from hybridrl.megatron.config import LR_DECAY_STYLES, OPTIMIZERS, MegatronConfig, OptimConfig, layout_problems
from hybridrl.megatron.optimizer_overrides import optimizer_config_notes, optimizer_config_problems
from hybridrl.megatron.stages import stage_sizes


def check_model(key: str, m: ModelConfig, issues: Issues, *, before_bootstrap: bool) -> HFArch | None:
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


HF_OVERRIDES = ("max_position_embeddings",)  # the config.json fields model.override_config may set


def apply_override_config(key: str, m: ModelConfig, model: HFArch | None, issues: Issues) -> HFArch | None:
    """``model`` as ``<key>.override_config`` changes it; its problems (a field that is not applied, a bad value)."""
    length = m.override_config.get("max_position_embeddings")
    for name, value in m.override_config.items():
        if name not in HF_OVERRIDES:
            issues.add(f"{key}.override_config.{name}", value, "not applied: only max_position_embeddings is (the "
                       "longest sequence; no weight or computation of a rotary-position model depends on it); change "
                       "other fields in the checkpoint's config.json")
    if length is None:
        return model
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        issues.add(f"{key}.override_config.max_position_embeddings", length, "must be an integer ≥ 1")
        return model
    return replace(model, max_position_embeddings=length) if model is not None else None


def check_layout(key: str, m: MegatronConfig, world: int, model: HFArch | None, issues: Issues, *,
                  world_note: str = "", planning: bool = False) -> None:
    """``world``: the ranks the layout spans (``world_note`` says why, when that is not the launched world);
    ``planning``: for another machine, whose Transformer Engine is not this one's."""
    te = None if planning else importlib.util.find_spec("transformer_engine") is not None
    for size, value, message in layout_problems(m, world_size=world, transformer_engine=te):
        issues.add(f"{key}.{size}", value, message + world_note)
    if model is not None:
        first, last = stage_sizes(m.override_transformer_config)
        for size, value, message in model.split_problems(
                tp=max(m.tensor_model_parallel_size, 1), pp=max(m.pipeline_model_parallel_size, 1),
                vpp=m.virtual_pipeline_model_parallel_size, ep=max(m.expert_model_parallel_size, 1),
                etp=m.expert_tensor_parallel_size, first=first, last=last):
            issues.add(f"{key}.{size}", value, message)
        if model.moe is not None and m.tensor_model_parallel_size > 1 and not m.sequence_parallel:
            issues.add(f"{key}.sequence_parallel", False,
                       f"an MoE model trains at tensor_model_parallel_size={m.tensor_model_parallel_size} only with "
                       "sequence parallelism (Megatron's MoE layer refuses TP without it); set it to true (it needs "
                       "Transformer Engine) or TP to 1")


def check_optim(key: str, o: OptimConfig, m: MegatronConfig, issues: Issues, *,
                 optimizer_steps: int | None, megatron_key: str, device_type: str | None,
                 planning: bool = False) -> list[str]:
    """``optimizer_steps``: the run's (None: not known yet, the warmup is checked once it is); ``megatron_key``: the
    Megatron block ``m`` is; ``device_type``: cpu | cuda (None: not known); ``planning``: for another machine, whose
    Transformer Engine is not this one's. Returns the notes of ``override_optimizer_config``."""
    te = None if planning else importlib.util.find_spec("transformer_engine") is not None
    for k, value, message in optimizer_config_problems(
            o.optimizer, o.override_optimizer_config, key=key, megatron_key=megatron_key,
            distributed_optimizer=m.use_distributed_optimizer, device_type=device_type, transformer_engine=te):
        issues.add(k, value, message)
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
    return optimizer_config_notes(o.override_optimizer_config, key=key)


def check_lengths(prompt: int, response: int, model: HFArch | None, issues: Issues) -> None:
    issues.positive("data.max_prompt_length", prompt)
    issues.positive("data.max_response_length", response)
    if model is not None and prompt + response > model.max_position_embeddings:
        issues.add("data.max_response_length", response,
                   f"data.max_prompt_length + data.max_response_length = {prompt + response} exceeds the model's "
                   f"max_position_embeddings {model.max_position_embeddings}; at most "
                   f"{model.max_position_embeddings - prompt}")


def check_critic(cfg: RLConfig, plan: Plan, actor_model: HFArch | None, issues: Issues, *,
                  before_bootstrap: bool, planning: bool = False) -> None:
    """The critic's layout is the actor's (shared process groups), its start model reads the actor's tokens."""
    c, actor_megatron = cfg.critic, cfg.actor_rollout_ref.actor.megatron
    for size, critic_value, actor_value in c.megatron.mismatches(actor_megatron):
        issues.add(f"critic.megatron.{size}", critic_value,
                   f"must equal {AOR}.actor.megatron.{size}={actor_value} (the critic shares the actor's Megatron "
                   "process groups); leave it null to follow the actor")
    plan.notes.extend(check_optim(
        "critic.optim", c.optim, actor_megatron, issues, megatron_key=f"{AOR}.actor.megatron",
        device_type=plan.device_type, planning=planning,
        optimizer_steps=plan.batch.critic.total_optimizer_steps
        if plan.batch.critic and cfg.trainer.total_training_steps is not None else None))
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
        first, last = stage_sizes(actor_megatron.override_transformer_config)
        for size, value, message in model.split_problems(
                tp=max(actor_megatron.tensor_model_parallel_size, 1),
                pp=max(actor_megatron.pipeline_model_parallel_size, 1),
                vpp=actor_megatron.virtual_pipeline_model_parallel_size,
                ep=max(actor_megatron.expert_model_parallel_size, 1), first=first, last=last):
            issues.add(f"{AOR}.actor.megatron.{size}", value, f"critic.model.path: {message}")


def check_fused_kernels(cfg: RLConfig, plan: Plan, issues: Issues) -> None:
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


def check_memory(cfg: RLConfig, plan: Plan, issues: Issues) -> None:
    """The plan's per-rank memory on the device (GPU plans only): a model state that cannot fit is refused, a peak
    over the device (activations and KV are estimates) is a note; each names what would shrink it."""
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
    m, a = cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.actor
    layout = [f"{AOR}.actor.megatron.tensor_model_parallel_size / pipeline_model_parallel_size (raise)"]
    if not m.use_distributed_optimizer:
        layout.append(f"{AOR}.actor.megatron.use_distributed_optimizer=true")
    if m.dtype == "float32":
        layout.append(f"{AOR}.actor.megatron.dtype=bfloat16")
    offload = [f"{AOR}.actor.megatron.{k}=true" for k in ("param_offload", "grad_offload", "optimizer_offload")
               if not getattr(m, k)]
    if mem.state > capacity * GB:
        engine = f"{AOR}.rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} (raise: engine weights)"
        issues.add("trainer.device_memory_gb", capacity,
                   f"the largest rank's model state alone (weights, gradients, optimizer state) needs "
                   f"~{mem.state / GB:.1f} GB ({mem}): it cannot fit; change: {'; '.join([*layout, *offload, engine])}")
        return
    if mem.peak <= capacity * GB:
        return
    helps = []
    if m.override_transformer_config.get("recompute_granularity") != "full":
        helps.append(f"activation recompute ({AOR}.model.enable_gradient_checkpointing=true)")
    helps.append(f"smaller micro-batches ({AOR}.actor."
                 f"{'ppo_max_token_len_per_gpu' if a.use_dynamic_bsz else 'ppo_micro_batch_size_per_gpu'} lower)")
    helps += [f"offload while generating ({', '.join(offload)})"] if offload else []
    if mem.pooled:
        helps.append(f"a smaller engine share ({AOR}.rollout.gpu_memory_utilization={r.gpu_memory_utilization} lower)")
    plan.notes.append(f"memory: the largest rank may need ~{mem.peak / GB:.1f} GB of the device's {capacity:.0f} GB "
                      f"(its model state {mem.state / GB:.1f} GB fits; activations and KV are estimates); if it runs "
                      f"out of memory: {'; '.join(helps)}")
