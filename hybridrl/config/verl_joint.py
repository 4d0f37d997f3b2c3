"""verl's keys that mean something only together (``status: joint`` in :mod:`hybridrl.config.verl_keys`), applied to
the composed config, where the values the command line left out are the recipe's.

- ``placement``: verl's one-step-off trainer gives the rollout its own GPUs, ``rollout.nnodes`` ×
  ``rollout.n_gpus_per_node`` of them, beside the trainer's ``trainer.nnodes`` × ``trainer.n_gpus_per_node``.
  hybridrl's launch is one world of ``trainer.nnodes`` × ``trainer.n_gpus_per_node`` ranks whose last
  ``rollout.num_ranks`` run the engines (``placement=disaggregated``): the engine GPUs are added to each node's
  ranks (rollout.nnodes = trainer.nnodes), or as nodes of their own (the same GPUs per node).
- ``distillation``: verl's teacher and distillation loss. hybridrl has one teacher (``actor_rollout_ref.teacher``),
  which scores in Megatron in the actor's layout (verl's ``distillation.nnodes=0``, its default), or with
  ``distillation.nnodes`` ≥ 1 on an engine of ``teacher_model.inference`` on ranks of its own
  (``teacher.inference``; its GPUs added to the launch as ``placement`` adds the rollout's). verl's
  ``use_policy_gradient=false`` (its default, with ``loss_mode=k3``) is a supervised loss term:
  ``actor_rollout_ref.teacher.loss`` with verl's fields (:mod:`hybridrl.algorithms.distillation_loss`:
  forward_kl_topk and the k1/k2/k3 estimators). ``use_policy_gradient=true`` with ``loss_mode=k1`` is the
  reverse-KL advantage: ``algorithm.adv_estimator=opd``, with ``use_task_rewards=true`` (GRPO's task advantage plus
  the distillation one) ``grpo_opd`` with ``distill_coef=distillation_loss_coef``. Deviation: verl adds the two
  terms as two clipped policy losses, hybridrl adds the advantages under one clip. verl's ``forward_kl_topk_tail``
  is not built: refused, naming what is.
- ``tools``: verl's tool YAML (``multi_turn.tool_config_path``), read into hybridrl's tool plugins
  (:mod:`hybridrl.config.verl_tools`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridrl.algorithms.distillation_loss import LOSS_MODES, DistillationLossConfig
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.schema import RLConfig
from hybridrl.config.verl_keys import AOR
from hybridrl.config.verl_tools import tool_config

ONE_STEP_OFF_ROLLOUT = {"rollout.nnodes": 1, "rollout.n_gpus_per_node": 8}  # verl's one_step_off_ppo_*_trainer.yaml
TEACHER = "distillation.teacher_models.teacher_model"
LOSS = "distillation.distillation_loss"
Applied = tuple[list[str], list[ConfigIssue]]  # notices, issues


def apply_joint(cfg: RLConfig, joint: dict[str, dict[str, Any]]) -> list[str]:
    """Apply each group's keys to ``cfg``; returns the notices, raises ConfigError with every group's problems."""
    notices: list[str] = []
    issues: list[ConfigIssue] = []
    for group, values in joint.items():
        n, i = GROUPS[group](cfg, values)
        notices += n
        issues += i
    if issues:
        raise ConfigError(issues)
    return notices


def placement(cfg: RLConfig, values: dict[str, Any]) -> Applied:
    v = {**ONE_STEP_OFF_ROLLOUT, **{k: x for k, x in values.items() if x is not None}}
    nodes, per_node = v["rollout.nnodes"], v["rollout.n_gpus_per_node"]
    t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    engines = nodes * per_node
    given = " × ".join(f"{k}={v[k]}" for k in ONE_STEP_OFF_ROLLOUT)
    if engines < 1:
        return [f"verl's {given}: no engine ranks of their own, the engines share the trainer's"], []
    if r.num_ranks is not None and r.num_ranks != engines:
        return [], [ConfigIssue(key="rollout.n_gpus_per_node", value=per_node, message=(
            f"{given} = {engines} engine ranks, and {AOR}.rollout.num_ranks={r.num_ranks}: set one"))]
    if (issue := _add_gpus(cfg, nodes, per_node, given=given, prefix="rollout", whose="the engine")) is not None:
        return [], [issue]
    r.placement, r.num_ranks = "disaggregated", engines
    world = t.nnodes * t.n_gpus_per_node
    return [f"verl's {given} is hybridrl's {AOR}.rollout.placement=disaggregated, num_ranks={engines}: trainer.nnodes="
            f"{t.nnodes} × trainer.n_gpus_per_node={t.n_gpus_per_node} = {world} ranks, the last {engines} run the "
            f"engines, the first {world - engines} train"], []


def _add_gpus(cfg: RLConfig, nodes: int, per_node: int, *, given: str, prefix: str, whose: str) -> ConfigIssue | None:
    """Add verl's separate pool of ``nodes`` × ``per_node`` GPUs to the launch (``trainer.nnodes`` ×
    ``trainer.n_gpus_per_node``): on the trainer's nodes, or as nodes of their own; None, or why it cannot."""
    t = cfg.trainer
    if nodes == t.nnodes:
        t.n_gpus_per_node += per_node
    elif per_node == t.n_gpus_per_node:
        t.nnodes += nodes
    else:
        return ConfigIssue(key=f"{prefix}.nnodes", value=nodes, message=(
            f"{given} beside trainer.nnodes={t.nnodes} × trainer.n_gpus_per_node={t.n_gpus_per_node}: hybridrl "
            f"launches the same ranks on every node, so {whose} GPUs go on the trainer's nodes ({prefix}.nnodes = "
            f"trainer.nnodes) or fill nodes of their own ({prefix}.n_gpus_per_node = trainer.n_gpus_per_node)"))
    return None


def distillation(cfg: RLConfig, values: dict[str, Any]) -> Applied:
    if not values.get("distillation.enabled"):
        rest = sorted(k for k in values if k != "distillation.enabled")
        return ([f"verl's {', '.join(rest)}: no effect while distillation.enabled is false"] if rest else []), []
    issues = []
    path = values.get(f"{TEACHER}.model_path")
    if path is None:
        issues.append(ConfigIssue(key=f"{TEACHER}.model_path", value=None,
                                  message="distillation.enabled=true needs the teacher's HF checkpoint"))
    loss_mode = values.get(f"{LOSS}.loss_mode", "k3")  # verl's defaults: a supervised k3 loss
    pg, task = values.get(f"{LOSS}.use_policy_gradient", False), values.get(f"{LOSS}.use_task_rewards", True)
    coef = float(values.get(f"{LOSS}.distillation_loss_coef", 1.0))
    alg, t = cfg.algorithm, cfg.actor_rollout_ref.teacher
    if pg:
        if loss_mode not in ("k1", "kl"):
            issues.append(ConfigIssue(key=f"{LOSS}.loss_mode", value=loss_mode, message=(
                "with use_policy_gradient=true hybridrl's distillation advantage is the per-token reverse KL "
                "log π − log π_teacher (k1: algorithm.adv_estimator=opd / grpo_opd); for a supervised "
                f"{loss_mode} loss set use_policy_gradient=false")))
        if task and alg.adv_estimator != "grpo":
            issues.append(ConfigIssue(key="algorithm.adv_estimator", value=alg.adv_estimator, message=(
                f"with {LOSS}.use_task_rewards=true hybridrl adds the distillation advantage to GRPO's (grpo_opd): "
                "use grpo, or use_task_rewards=false (the distillation advantage alone: opd)")))
        clamp = values.get(f"{LOSS}.loss_max_clamp")
        if clamp is not None:
            issues.append(ConfigIssue(key=f"{LOSS}.loss_max_clamp", value=clamp, message=(
                "the distillation advantage is not clamped here (the clipped policy loss bounds each update): "
                "leave it null, or use_policy_gradient=false (a supervised loss, clamped)")))
    elif loss_mode not in LOSS_MODES:
        issues.append(ConfigIssue(key=f"{LOSS}.loss_mode", value=loss_mode, message=(
            f"the supervised distillation losses built: {', '.join(LOSS_MODES)} "
            "(verl's forward_kl_topk_tail is not)")))
    engine_notes, engine_issues = _teacher_engine(cfg, values)
    issues += engine_issues
    if issues:
        return [], issues
    t.model.path = path
    return [*_distillation_loss(cfg, values, path=path, loss_mode=loss_mode, pg=pg, task=task, coef=coef),
            *engine_notes], []


def _teacher_engine(cfg: RLConfig, values: dict[str, Any]) -> Applied:
    """verl's teacher on GPUs of its own (``distillation.nnodes`` ≥ 1 nodes × ``distillation.n_gpus_per_node``,
    served by ``teacher_model.inference``) is ``teacher.inference`` on as many ranks of their own, added to the
    launch as the one-step-off rollout's are (``placement``); ``nnodes=0`` (verl's default) shares the trainer's
    GPUs, which here is the Megatron teacher in the actor's layout."""
    nodes, per_node = values.get("distillation.nnodes", 0), values.get("distillation.n_gpus_per_node", 8)
    if not nodes:
        return [], []
    t, i = cfg.trainer, cfg.actor_rollout_ref.teacher.inference
    given = f"distillation.nnodes={nodes} × distillation.n_gpus_per_node={per_node}"
    if (issue := _add_gpus(cfg, nodes, per_node, given=given, prefix="distillation", whose="the teacher's")):
        return [], [issue]
    i.name = values.get(f"{TEACHER}.inference.name") or cfg.actor_rollout_ref.rollout.name
    i.num_ranks = nodes * per_node
    i.tensor_model_parallel_size = values.get(f"{TEACHER}.inference.tensor_model_parallel_size", 2)
    i.gpu_memory_utilization = values.get(f"{TEACHER}.inference.gpu_memory_utilization", 0.5)
    world = t.nnodes * t.n_gpus_per_node
    return [f"verl's {given} is hybridrl's {AOR}.teacher.inference (name={i.name}, num_ranks={i.num_ranks}, "
            f"tensor_model_parallel_size={i.tensor_model_parallel_size}): trainer.nnodes={t.nnodes} × "
            f"trainer.n_gpus_per_node={t.n_gpus_per_node} = {world} ranks, the last {i.num_ranks} serve the teacher"
            ], []


def _distillation_loss(cfg: RLConfig, values: dict[str, Any], *, path: str, loss_mode: str, pg: bool, task: bool,
                       coef: float) -> list[str]:
    alg, t = cfg.algorithm, cfg.actor_rollout_ref.teacher
    if pg:
        coef = coef if task else 1.0
        alg.adv_estimator = "grpo_opd" if task else "opd"
        alg.adv_estimator_kwargs["distill_coef"] = coef
        return [f"verl's distillation.* is hybridrl's {AOR}.teacher.model.path={path}, algorithm.adv_estimator="
                f"{alg.adv_estimator} (distill_coef={coef})"]
    t.loss = DistillationLossConfig(
        loss_mode=loss_mode, topk=values.get(f"{LOSS}.topk", 32), use_task_rewards=task,
        distillation_loss_coef=coef if task else 1.0, loss_max_clamp=values.get(f"{LOSS}.loss_max_clamp"),
        log_prob_min_clamp=values.get(f"{LOSS}.log_prob_min_clamp"))
    return [f"verl's distillation.* is hybridrl's {AOR}.teacher.model.path={path} and {AOR}.teacher.loss "
            f"(loss_mode={loss_mode}, use_task_rewards={task}, distillation_loss_coef={t.loss.distillation_loss_coef})"
            ]


GROUPS: dict[str, Callable[[RLConfig, dict[str, Any]], Applied]] = {
    "placement": placement, "distillation": distillation, "tools": tool_config}
