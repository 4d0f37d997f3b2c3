"""Checks of the run around the models: data files, trainer keys, loggers, timeouts, the reward runner."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from hybridrl import bootstrap
from hybridrl.config.errors import Issues
from hybridrl.config.plan import AOR, critic_needed
from hybridrl.config.schema import DEVICES, RLConfig, TrainerConfig
from hybridrl.config.sft_schema import SFTTrainerConfig
from hybridrl.data.checks import file_problems
from hybridrl.data.sources import VALID as VALID_DATA
from hybridrl.data.sources import is_hf, source_problem
from hybridrl.registry import PluginError, Registry
from hybridrl.rewards.execution import config_problems as reward_config_problems
from hybridrl.run_lock import output_dir_problem
from hybridrl.tracking import LOGGERS, missing_logger_packages


def device_type(device: str, *, planning: bool = False) -> str:
    """``trainer.device`` resolved: ``auto`` is cuda where a GPU is visible (or when planning a run for
    another machine), else cpu."""
    if device != "auto":
        return device
    if planning:
        return "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_data(issues: Issues, prefix: str, train_files: list[str], val_files: list[str], build: str | None, *,
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


def check_trainer(cfg: RLConfig, issues: Issues, *, planning: bool = False) -> None:
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
    check_tracking(t, issues, planning=planning)
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


def check_tracking(t: TrainerConfig | SFTTrainerConfig, issues: Issues, *, planning: bool = False) -> None:
    """Known logger names; and, unless planning a run for another machine, their packages installed here."""
    if t.test_freq < 0:
        issues.add("trainer.test_freq", t.test_freq, "must be ≥ 0 (0 = never)")
    bad = [lg for lg in t.logger if lg not in LOGGERS]
    if bad:
        issues.add("trainer.logger", list(t.logger), f"unknown logger(s) {bad}; valid: {', '.join(LOGGERS)}")
    for name, install in ({} if planning else missing_logger_packages(t.logger)).items():
        issues.add("trainer.logger", list(t.logger), f"logger {name!r}: {install} (or drop it from the list)")


def check_timeouts(cfg: RLConfig, issues: Issues) -> None:
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
            continue  # reported by check_plugins
        waits += [(f"{key}.{f.name}", getattr(plugin_cfg, f.name)) for f in dataclasses.fields(plugin_cfg)
                  if f.name.endswith("_timeout_s")]
    for key, value in waits:
        if value is not None and value <= 0:
            issues.add(key, value, "must be > 0 (or null: no limit)")
        elif value is None or value >= limit:
            issues.add(key, value, f"must be below trainer.dist_timeout_s={limit} (a rank waits in a collective "
                                   f"meanwhile); lower it or raise trainer.dist_timeout_s")


def check_reward(cfg: RLConfig, issues: Issues) -> None:
    """``reward.on_error``, ``reward.num_workers``, the overlap flag and the worst-case wait: the runner's rules."""
    for key, value, message in reward_config_problems(cfg.reward, dist_timeout_s=cfg.trainer.dist_timeout_s):
        issues.add(key, value, message)
