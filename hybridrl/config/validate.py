"""Static validation: the whole config is checked before any model or engine is built.

Each rule lives with the object that owns it — the plan (placement, batch arithmetic), the HF
checkpoint reader (architecture, how sizes split the model), Megatron's layout rules, the plugins'
``Config`` classes, the loss/KL/logger/data-format lists of the modules that implement them — and
validation collects their problems into one ``ConfigError``, each naming its key, value and what
would be valid. Reads only config files, the checkpoint's ``config.json`` and plugin classes (which
import torch, never Megatron or an engine).

This module runs the pass; the rules are grouped by what they check: ``check_models`` (models, layout,
optimizer, memory), ``check_rollout`` (sampling, algorithm, plugins, async, multi-turn, expert routing) and
``check_run`` (data, trainer, loggers, timeouts, reward runner), each adding to one
:class:`~hybridrl.config.errors.Issues`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace
from pathlib import Path

from hybridrl import bootstrap
from hybridrl.algorithms.dynamic_sampling import config_problems as dynamic_sampling_problems
from hybridrl.config import teacher
from hybridrl.config.check_models import (
    apply_override_config,
    check_critic,
    check_fused_kernels,
    check_layout,
    check_lengths,
    check_memory,
    check_model,
    check_optim,
)
from hybridrl.config.check_rollout import (
    check_algorithm,
    check_async,
    check_expert_parallel_batches,
    check_multi_turn,
    check_plugins,
    check_rollout_correction,
    check_router_replay,
    check_sampling,
    check_shared_prompt_model,
)
from hybridrl.config.check_run import (
    check_data,
    check_reward,
    check_timeouts,
    check_tracking,
    check_trainer,
    device_type,
)
from hybridrl.config.check_vlm import vlm_layout, vlm_problems
from hybridrl.config.derived import derive
from hybridrl.config.errors import ConfigError, Issues
from hybridrl.config.plan import AOR, Plan, RoleLayout
from hybridrl.config.schema import DEVICES, RLConfig
from hybridrl.config.sft_schema import SFTConfig, target_problems
from hybridrl.data.rows import TRUNCATIONS
from hybridrl.hf.arch import HFArch
from hybridrl.lora.config import lora_problems
from hybridrl.megatron.config import interleaved_micro_batches_problem
from hybridrl.megatron.transformer_overrides import NOT_PASSED, megatron_config_notes, megatron_config_problems
from hybridrl.rewards.overlong import config_problems as overlong_problems

VLM_NOTE = ("a vision-language model: its prompts' images go to the rollout engine and to the policy's vision tower "
            "(first pipeline stage); its micro-batches are padded rows (use_remove_padding applies to text models)")


def validate(cfg: RLConfig, *, world_size: int | None = None, before_bootstrap: bool = False,
             model_config: Path | None = None, ranks_per_node: int | None = None,
             teacher_config: Path | None = None) -> Plan:
    """Check ``cfg`` for a run on ``world_size`` ranks; return its plan or raise ConfigError. ``cfg`` is not
    changed: the checks read :func:`~hybridrl.config.derived.derive`'s copy, which the plan carries
    (``plan.config``: what the run uses).

    ``before_bootstrap``: a model or data file that the config builds when missing
    (``build_if_missing``, inside the hybridrl cache) may not exist yet; the checks that need it wait
    (``plan.waits_for_build``: run ``validate`` once more after the build).
    ``model_config``: plan a run on another machine: take the architecture from this config.json
    instead of the model directory, and skip every check of local files (weights, tokenizer, data);
    ``teacher_config``: the distillation teacher's config.json when planning (else its own, when it is here, or the
    student's architecture, with a note).
    """
    issues = Issues()
    cfg, steps_problem, derived_notes = derive(cfg)  # total_epochs → total_training_steps (verl's rule), …
    t, aor = cfg.trainer, cfg.actor_rollout_ref
    if steps_problem is not None:
        issues.add("trainer.total_epochs", t.total_epochs, steps_problem)
    world = world_size if world_size is not None else t.nnodes * t.n_gpus_per_node
    if world < 1:
        issues.add("trainer.n_gpus_per_node", t.n_gpus_per_node, "world size must be ≥ 1")
        world = 1
    planning = model_config is not None
    if model_config is not None:
        model = planned_model(model_config, issues)
    else:
        model = check_model(f"{AOR}.model", aor.model, issues, before_bootstrap=before_bootstrap)
    model = apply_override_config(f"{AOR}.model", aor.model, model, issues)
    derived_notes += vlm_layout(cfg, model)  # e.g. sequence parallelism off for a VLM
    for key, value, message in lora_problems(aor.model, key=f"{AOR}.model"):
        issues.add(key, value, message)
    if planning:
        teacher_arch, teacher_issues = teacher.planned_teacher(cfg, teacher_config, model, notes=derived_notes)
    else:
        teacher_arch, teacher_issues = teacher.teacher_model(cfg, before_bootstrap=before_bootstrap)
    for key, value, message in teacher_issues + teacher.teacher_layout_problems(cfg, teacher_arch):
        issues.add(key, value, message)
    if teacher_arch is not None and model is not None and not teacher_issues and not planning:
        for key, value, message in teacher.tokenizer_problems(cfg):
            issues.add(key, value, message)
    plan, plan_issues = Plan.build(cfg, world_size=world, model=model, ranks_per_node=ranks_per_node,
                                   teacher_model=teacher_arch,
                                   device_type=device_type(t.device, planning=planning) if t.device in DEVICES
                                   else "cpu")
    issues += plan_issues
    for key, value, message in teacher.inference_problems(cfg, world=world, ranks_per_node=plan.ranks_per_node,
                                                          device_type=plan.device_type, teacher=teacher_arch):
        issues.add(key, value, message)
    check_layout(f"{AOR}.actor.megatron", aor.actor.megatron, plan.trainer_world_size, model, issues, planning=planning,
                  world_note=_trainer_world_note(plan))
    deep_ep = None if planning else importlib.util.find_spec("deep_ep") is not None
    moe = model.moe is not None if model is not None else None
    overrides = aor.actor.megatron.override_transformer_config
    for key, value, message in megatron_config_problems(aor.actor.megatron.dtype, overrides,
                                                        key=f"{AOR}.actor.megatron", moe=moe,
                                                        device_type=plan.device_type, deep_ep=deep_ep):
        issues.add(key, value, message)
    derived_notes += megatron_config_notes(overrides, key=f"{AOR}.actor.megatron", moe=moe, deep_ep=deep_ep)
    if "ref" in plan.roles:  # one Megatron parallel_state per process: the ref runs on the actor's layout
        for size, ref_value, actor_value in aor.ref.megatron.mismatches(aor.actor.megatron):
            issues.add(f"{AOR}.ref.megatron.{size}", ref_value,
                       f"must equal {AOR}.actor.megatron.{size}={actor_value} (the ref shares the actor's Megatron "
                       "process groups); leave it null to follow the actor")
    check_sampling(cfg, issues)
    plan.notes.extend(derived_notes)
    if model is not None and model.vision is not None:
        plan.notes.append(VLM_NOTE)
    steps = plan.batch.total_optimizer_steps if t.total_training_steps is not None else None
    plan.notes.extend(check_optim(f"{AOR}.actor.optim", aor.actor.optim, aor.actor.megatron, issues,
                                  optimizer_steps=steps, megatron_key=f"{AOR}.actor.megatron",
                                  device_type=plan.device_type, planning=planning))
    check_algorithm(cfg, issues)
    overlong = overlong_problems(cfg.reward.overlong_buffer, max_response_length=cfg.data.max_response_length)
    sampling = dynamic_sampling_problems(cfg.algorithm.filter_groups, train_batch_size=cfg.data.train_batch_size,
                                         gen_batch_size=cfg.data.gen_batch_size, n=aor.rollout.n)
    for key, value, message in sampling + overlong:  # DAPO's two
        issues.add(key, value, message)
    check_rollout_correction(cfg, issues)
    check_async(cfg, world, issues)
    check_plugins(cfg, plan, issues)
    check_router_replay(cfg, model, issues)
    check_expert_parallel_batches(cfg, issues)
    check_shared_prompt_model(cfg, model, issues)
    check_multi_turn(cfg, issues)
    for key, value, message in vlm_problems(cfg, model, planning=planning):
        issues.add(key, value, message)
    if "critic" in plan.roles:
        check_critic(cfg, plan, model, issues, before_bootstrap=before_bootstrap or planning, planning=planning)
    check_lengths(cfg.data.max_prompt_length, cfg.data.max_response_length, model, issues)
    issues.positive("data.val_batch_size", cfg.data.val_batch_size)
    if cfg.data.truncation not in TRUNCATIONS:
        issues.add("data.truncation", cfg.data.truncation, f"valid: {', '.join(TRUNCATIONS)} (used when "
                   "data.filter_overlong_prompts=false: a longer prompt is an error, or cut keeping its left/right/"
                   "middle tokens)")
    if not planning:
        check_data(issues, "data", cfg.data.train_files, cfg.data.val_files, cfg.data.build_if_missing,
                    before_bootstrap=before_bootstrap, columns={"data.prompt_key": cfg.data.prompt_key,
                                                                "data.ground_truth_key": cfg.data.ground_truth_key})
    check_trainer(cfg, issues, planning=planning)
    check_timeouts(cfg, issues)
    check_reward(cfg, issues)
    check_memory(cfg, plan, issues)
    if not planning:
        check_fused_kernels(cfg, plan, issues)
    if issues:
        raise ConfigError(list(issues))
    return replace(plan, waits_for_build=before_bootstrap and not planning and _will_build(cfg))


def _will_build(cfg: RLConfig) -> bool:
    """Whether the run builds a model or data file first (``build_if_missing``): the checks of it waited."""
    aor, d = cfg.actor_rollout_ref, cfg.data
    models = [(aor.model.build_if_missing, aor.model.path), (aor.teacher.model.build_if_missing,
                                                             aor.teacher.model.path)]
    return (any(p is not None and bootstrap.will_build(kind, p, model=True) for kind, p in models)
            or any(bootstrap.will_build(d.build_if_missing, f, model=False) for f in [*d.train_files[:1],
                                                                                        *d.val_files[:1]]))


def validate_sft(cfg: SFTConfig, *, world_size: int | None = None, before_bootstrap: bool = False,
                 model_config: Path | None = None, takes_images: bool = True) -> RoleLayout:
    """Static checks of an SFT run (the subset of ``validate`` that applies); returns its layout. ``model_config``:
    plan for another machine (the architecture from this config.json; local weights, tokenizer and data unchecked).
    ``takes_images``: False for the trainers that check their config through this one but have no image path yet
    (DPO, the reward model)."""
    issues = Issues()
    world = world_size if world_size is not None else cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if model_config is not None:
        model = planned_model(model_config, issues)
    else:
        model = check_model("model", cfg.model, issues, before_bootstrap=before_bootstrap)
        if model is not None and model.vision is not None and not takes_images:
            issues.add("model.path", cfg.model.path, "a vision-language model: DPO and the reward model do not take "
                       "images yet (issue 46); SFT and the RL trainer do")
    if model is not None and model.vision is not None and cfg.megatron.sequence_parallel:
        issues.add("megatron.sequence_parallel", True, "not with a vision-language model yet (image features enter "
                   "the embeddings before sequence parallelism would scatter them); set it to false")
    model = apply_override_config("model", cfg.model, model, issues)
    for key, value, message in lora_problems(cfg.model, key="model"):
        issues.add(key, value, message)
    check_layout("megatron", cfg.megatron, world, model, issues)
    for key, value, message in megatron_config_problems(cfg.megatron.dtype, cfg.megatron.override_transformer_config,
                                                        key="megatron"):
        issues.add(key, value, message)
    for name, why in NOT_PASSED.items():  # an RL run drops them (derive); an SFT config is hybridrl's own
        if cfg.megatron.override_transformer_config.get(name):
            issues.add(f"megatron.override_transformer_config.{name}", True, f"not passed to Megatron: {why}; set "
                       "false or remove it")
    layout = RoleLayout.of(cfg.megatron, world)
    check_optim("optim", cfg.optim, cfg.megatron, issues, optimizer_steps=cfg.trainer.total_training_steps,
                 megatron_key="megatron", device_type=None, planning=model_config is not None)
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
    check_lengths(d.max_prompt_length, d.max_response_length, model, issues)
    if model_config is None:
        check_data(issues, "data", d.train_files, d.val_files, d.build_if_missing, before_bootstrap=before_bootstrap,
                   columns={"data.prompt_key": d.prompt_key})
    issues.positive("trainer.total_training_steps", cfg.trainer.total_training_steps)
    for key, value, message in target_problems(cfg.trainer, val_files=d.val_files):
        issues.add(key, value, message)
    check_tracking(cfg.trainer, issues)
    if issues:
        raise ConfigError(list(issues))
    return layout


def planned_model(model_config: Path, issues: Issues) -> HFArch | None:
    """The architecture of ``--model-config`` (planning for another machine); its problem goes to ``issues``."""
    try:
        return HFArch.from_hf(model_config)
    except (OSError, KeyError, ValueError, NotImplementedError) as e:
        issues.add("--model-config", str(model_config), str(e))
        return None


def world_from_env() -> tuple[int, int | None]:
    """``(world size, ranks per node)`` of this torchrun launch (1 and None outside torchrun)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(os.environ.get("WORLD_SIZE", "1")), int(local) if local else None


def _trainer_world_note(plan: Plan) -> str:
    """Why the trainer's world is smaller than the launch's (ranks of their own for the rollout or the teacher)."""
    less = [f"{AOR}.rollout.num_ranks={plan.num_engine_ranks}"] if plan.num_engine_ranks else []
    less += [f"{AOR}.teacher.inference.num_ranks={plan.num_teacher_ranks}"] if plan.num_teacher_ranks else []
    return (f" (the {plan.trainer_world_size} trainer ranks: the world size {plan.world_size} less "
            f"{' and '.join(less)})" if less else "")

