"""What ``launch/train.py``, ``launch/sft.py``, ``launch/dpo.py`` and ``launch/rm.py`` run once Hydra has composed
the config.

A mistake in the run's input (:class:`~hybridrl.config.errors.UserError`: config, data, checkpoints) ends the run
with its one message as the last thing the rank prints and exit code 2, on rank 0 (every rank raises it), and in
torchrun's failure summary (the rank's error file), never a traceback; ``HYBRIDRL_DEBUG=1`` raises it as is. Any
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from omegaconf import DictConfig

from hybridrl import preemption
from hybridrl.bootstrap import ensure_data, ensure_model
from hybridrl.config.compose import available_recipes, compose_config, to_typed
from hybridrl.config.dpo_schema import DPOConfig, to_typed_dpo, validate_dpo
from hybridrl.config.errors import UserError
from hybridrl.config.plan import Plan
from hybridrl.config.rm_schema import RMConfig, to_typed_rm, validate_rm
from hybridrl.config.schema import RLConfig
from hybridrl.config.sft_schema import SFTConfig
from hybridrl.config.validate import validate, validate_sft, world_from_env
from hybridrl.distributed import check as dist_check
from hybridrl.tracking import say

R = TypeVar("R")
DEBUG_ENV = "HYBRIDRL_DEBUG"  # set (not 0): a UserError keeps its traceback
USAGE = "usage: torchrun --nproc-per-node N launch/train.py recipe=NAME [key=value ...]"


def one_line_on_user_error(run: Callable[..., R]) -> Callable[..., R]:
    """``run`` with a :class:`UserError` ending the process in one line (see the module docstring)."""

    @functools.wraps(run)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        try:
            return run(*args, **kwargs)
        except UserError as e:
            if os.environ.get(DEBUG_ENV, "0") not in ("", "0"):
                raise
            end_run(e)
        except Exception:
            preemption.exit_if_orphaned()  # a peer's exit seen first as a failed collective: say the real cause
            raise

    return wrapper


def end_run(error: UserError) -> NoReturn:
    """Exit 2 with ``error``'s message: printed by rank 0 (every rank meets the same error), and written to this
    rank's torchrun error file, so that torchrun's failure summary, printed last, ends with it too."""
    message, first = f"hybridrl: {error}", os.environ.get("RANK", "0") == "0"
    if first:
        print(message, file=sys.stderr, flush=True)
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):  # shown as the summary's "traceback :" line
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                                     "timestamp": str(int(time.time()))}}}, f)
    sys.stdout.flush()
    if not first:  # torchrun stops every rank at the first exit: rank 0's, whose line is then printed
        time.sleep(1.0)
    sys.exit(2)


@one_line_on_user_error
def run_rl_cli(argv: list[str]) -> int:
    """``launch/train.py``: compose ``argv`` (Hydra overrides) as ``hybridrl validate`` does, then run."""
    if any(a in ("-h", "--help") for a in argv):
        print(f"{USAGE}\n  recipes: {', '.join(available_recipes())}; check a config first with: hybridrl validate "
              "recipe=NAME [key=value ...]; verl's keys: docs/verl.md")
        return 0
    if flags := [a for a in argv if a.startswith("-")]:
        print(f"hybridrl: launch/train.py takes key=value overrides only, not {' '.join(flags)} (Hydra's "
              f"--config-path/--config-name: pick a recipe with recipe=NAME)\n{USAGE}", file=sys.stderr)
        return 2
    run_rl(compose_config(argv))
    return 0


@one_line_on_user_error
def run_rl(cfg: RLConfig) -> dict[str, float]:
    preemption.watch_launcher()  # from the start: a warm start's build is minutes of work a dead launcher must end too
    world, per_node = world_from_env()
    plan = validate(cfg, world_size=world, ranks_per_node=per_node, before_bootstrap=True)  # fail fast, build nothing
    ensure_data(cfg.data.build_if_missing, cfg.data.train_files, cfg.data.val_files)
    ensure_model(cfg.actor_rollout_ref.model.build_if_missing, cfg.actor_rollout_ref.model.path)
    if (teacher := cfg.actor_rollout_ref.teacher.model).path is not None:  # on-policy distillation's
        ensure_model(teacher.build_if_missing, teacher.path, key="actor_rollout_ref.teacher.model")
    if plan.waits_for_build:  # the checks of what was just built, and the steps counted from built data
        plan = validate(cfg, world_size=world, ranks_per_node=per_node)
    say("config OK\n" + plan.render())
    preempt = preemption.install(cfg.trainer.preempt_grace_s)  # a SIGTERM from now on: stop after the step, saved
    try:
        return _run_rl(plan.config, plan)
    finally:
        preempt.finished()


def _run_rl(cfg: RLConfig, plan: Plan) -> dict[str, float]:
    from hybridrl.rollout import disaggregated, teacher_service

    if plan.is_teacher_rank(rank := disaggregated.launch_rank()):  # serves the teacher, builds nothing else
        teacher_service.serve(cfg, plan, rank)
        return {}
    if disaggregated.split_world(plan):  # an engine rank: serves the trainer, builds nothing of it
        disaggregated.serve(cfg, plan)
        return {}
    from hybridrl.megatron.parallel import destroy_parallel
    from hybridrl.trainers.components import build_components  # heavy imports (Megatron) only after validation
    from hybridrl.trainers.rl import fit

    c = build_components(cfg, plan)
    try:
        return fit(c)
    finally:
        c.close()
        if dist_check.enabled():
            say(dist_check.report())
        destroy_parallel()


@one_line_on_user_error
def run_sft(dcfg: DictConfig) -> dict[str, float]:
    cfg = to_typed(dcfg)
    assert isinstance(cfg, SFTConfig)
    return _run_offline(cfg, validate_sft, "hybridrl.trainers.sft", "fit_sft")


@one_line_on_user_error
def run_dpo(dcfg: DictConfig) -> dict[str, float]:
    cfg = to_typed_dpo(dcfg)
    assert isinstance(cfg, DPOConfig)
    return _run_offline(cfg, validate_dpo, "hybridrl.trainers.dpo", "fit_dpo")


@one_line_on_user_error
def run_rm(dcfg: DictConfig) -> dict[str, float]:
    cfg = to_typed_rm(dcfg)
    return _run_offline(cfg, validate_rm, "hybridrl.trainers.rm", "fit_rm")


def _run_offline(cfg: SFTConfig | DPOConfig | RMConfig, check: Callable[..., Any], module: str,
                 fit: str) -> dict[str, float]:
    """SFT, DPO and the reward model: check the config (all problems at once, before anything is built), build
    missing data and start model, check again, then train with ``module.fit`` (Megatron imported only once the config
    passed)."""
    import importlib

    preemption.watch_launcher()  # under torchrun: a killed launcher ends the run (no SIGTERM handling offline)
    world, _ = world_from_env()
    check(cfg, world_size=world, before_bootstrap=True)
    ensure_data(cfg.data.build_if_missing, cfg.data.train_files, cfg.data.val_files)
    ensure_model(cfg.model.build_if_missing, cfg.model.path)
    check(cfg, world_size=world)
    from hybridrl.megatron.parallel import destroy_parallel

    try:
        return getattr(importlib.import_module(module), fit)(cfg)
    finally:
        destroy_parallel()
