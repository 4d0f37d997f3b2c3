"""Keys whose values follow from others (verl's rules), filled in before validation: :func:`derive` returns a
copy of the config with them resolved, the config it was given is left as it is.

How long a run is: ``trainer.total_training_steps``, or ``trainer.total_epochs`` over the training rows.
verl's rule: ``total_training_steps = len(train_dataloader) · total_epochs``, overridden by
``trainer.total_training_steps`` when that is set; its dataloader drops the last incomplete batch, so
``len(train_dataloader) = ⌊rows / data.train_batch_size⌋``. Deviation: the rows are counted as read (parquet
metadata, jsonl lines), before the prompt-length filter drops any — the plan (LR schedule, checks) is made
before the prompts are tokenized; a run whose filter drops prompts then trains slightly more than
``total_epochs`` passes over what is left. Under ``algorithm.filter_groups`` a step draws
``data.gen_batch_size`` prompts per round, so an epoch there is counted in steps of ``train_batch_size``, as
verl counts it.

``actor_rollout_ref.model.enable_gradient_checkpointing`` (verl's key) turns on Megatron's activation recompute
for every trained and frozen model of the run — full granularity, uniform method, one layer per checkpoint,
as verl's Megatron workers set it — unless ``megatron.override_transformer_config`` sets ``recompute_*`` itself.
``actor.router_replay.mode=R3`` turns on the rollout engine's ``return_routed_experts`` where its config has that
switch (vLLM, SGLang: the experts are recorded only by an engine started so).

verl's "none" spellings, as verl reads them (:func:`apply_verl_rules`): ``optim.lr_warmup_steps`` < 0 means
``lr_warmup_steps_ratio`` of the steps (only 0 is accepted here: no warm-up), ``trainer.test_freq`` < 0 never
evaluates, and ``megatron.sequence_parallel=true`` at TP = 1 is off (verl's ``McoreEngineConfig`` turns it off
with a warning; sequence parallelism splits over the TP ranks, so there is nothing to split). Override keys
hybridrl accepts but does not hand to Megatron are taken out
(:data:`~hybridrl.megatron.transformer_overrides.NOT_PASSED`), each with a note.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from hybridrl.config.plugin_kwargs import resolve_plugin_kwargs
from hybridrl.config.schema import RLConfig
from hybridrl.data.sources import is_hf
from hybridrl.megatron.transformer_overrides import NOT_PASSED


def derive(cfg: RLConfig) -> tuple[RLConfig, str | None, list[str]]:
    """``cfg`` with what follows from other keys filled in — the run's length from ``trainer.total_epochs``, verl's
    gradient-checkpointing flag as Megatron's recompute settings, verl's "none" spellings, each plugin block as its
    chosen plugin's kwargs — as a new config (``cfg`` is not changed). Returns ``(config, problem, notes)``: the
    problem of :func:`resolve_total_steps`, and what the plan should say about the settings filled in."""
    out = copy.deepcopy(cfg)
    problem, note = resolve_total_steps(out)
    apply_gradient_checkpointing(out)
    notes = apply_verl_rules(out)
    resolve_plugin_kwargs(out)
    apply_routed_experts(out)
    apply_model_overrides(out)
    return out, problem, ([note] if note is not None else []) + notes


def apply_routed_experts(cfg: RLConfig) -> None:
    """R3 router replay needs the engine to record its routing from the start: an engine whose config has a
    ``return_routed_experts`` switch (vLLM's aux output, SGLang's server arg) gets it on unless ``engine_kwargs``
    sets it."""
    from dataclasses import fields

    from hybridrl.registry import PluginError, Registry

    r = cfg.actor_rollout_ref.rollout
    if cfg.actor_rollout_ref.actor.router_replay.mode != "R3":
        return
    try:
        config = Registry("rollout_engines").load(r.name, key="actor_rollout_ref.rollout.name").Config
    except (PluginError, AttributeError):
        return  # validation reports an engine that does not load
    if "return_routed_experts" in {f.name for f in fields(config)}:
        r.engine_kwargs.setdefault("return_routed_experts", True)


def count_rows(files: list[str]) -> int | None:
    """Rows of the data entries without reading them (None: one cannot be counted here: missing, or hf://)."""
    total = 0
    for f in files:
        path = Path(f)
        if is_hf(f) or not path.is_file():
            return None
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # only when there is a file to count (planning elsewhere imports none)

            total += pq.ParquetFile(path).metadata.num_rows
        else:
            with path.open("rb") as fh:
                total += sum(1 for line in fh if line.strip())
    return total


def resolve_total_steps(cfg: RLConfig) -> tuple[str | None, str | None]:
    """Set ``cfg.trainer.total_training_steps`` from ``total_epochs`` when it is null and the rows can be
    counted. Returns ``(problem, note)``: a problem is a config error (for the key ``trainer.total_epochs``), a
    note says how the steps were found or why they are not known yet (the data is built or read later)."""
    t, d = cfg.trainer, cfg.data
    if t.total_training_steps is not None:
        return None, None
    if t.total_epochs < 1:
        return f"must be ≥ 1 when trainer.total_training_steps is null (it is {t.total_epochs})", None
    rows = count_rows(list(d.train_files)) if d.train_files else None
    if rows is None:
        return None, (f"total steps not known yet: trainer.total_epochs={t.total_epochs} × ⌊rows of data.train_files"
                      f" / {d.train_batch_size}⌋, counted once the files are here (or set "
                      "trainer.total_training_steps)")
    per_epoch = rows // max(d.train_batch_size, 1)
    if per_epoch < 1:
        return (f"data.train_files hold {rows} rows, fewer than one batch of data.train_batch_size="
                f"{d.train_batch_size}: no step in an epoch"), None
    t.total_training_steps = per_epoch * t.total_epochs
    return None, (f"total steps {t.total_training_steps} = trainer.total_epochs {t.total_epochs} × {per_epoch} "
                  f"steps per epoch ({rows} rows // data.train_batch_size {d.train_batch_size})")


AOR = "actor_rollout_ref"
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def apply_gradient_checkpointing(cfg: RLConfig) -> None:
    """``enable_gradient_checkpointing`` into the actor's ``override_transformer_config`` (the ref and critic use
    the actor's), leaving alone any ``recompute_*`` key set there."""
    if not cfg.actor_rollout_ref.model.enable_gradient_checkpointing:
        return
    override = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    if not any(k.startswith("recompute_") for k in override):
        override.update(RECOMPUTE)


def apply_verl_rules(cfg: RLConfig) -> list[str]:
    """verl's readings of a negative warm-up or test frequency and of sequence parallelism at TP = 1 (the module
    docstring); drops the override keys Megatron does not get. Returns a note for each setting changed."""
    aor, notes = cfg.actor_rollout_ref, []
    for optim in (aor.actor.optim, cfg.critic.optim):
        optim.lr_warmup_steps = max(optim.lr_warmup_steps, 0)
    cfg.trainer.test_freq = max(cfg.trainer.test_freq, 0)
    m = aor.actor.megatron
    if m.sequence_parallel and m.tensor_model_parallel_size == 1:
        m.sequence_parallel = False
        notes.append(f"sequence parallelism off: {AOR}.actor.megatron.tensor_model_parallel_size=1 (there is nothing "
                     "to split; verl turns it off too)")
    for name, why in NOT_PASSED.items():
        if m.override_transformer_config.pop(name, None):
            notes.append(f"{AOR}.actor.megatron.override_transformer_config.{name} is not passed to Megatron: {why}")
    return notes


def apply_model_overrides(cfg: RLConfig) -> None:
    """``model.override_config`` (max_position_embeddings) into the chosen engine's own override of the checkpoint's
    config: vLLM's ``hf_overrides``, SGLang's ``json_model_override_args`` (what the engine_kwargs give wins). The
    hf engine and Megatron need none: rotary positions have no length bound."""
    overrides, r = dict(cfg.actor_rollout_ref.model.override_config), cfg.actor_rollout_ref.rollout
    if not overrides:
        return
    if r.name == "vllm":
        args = dict(r.engine_kwargs.get("engine_args") or {})
        args["hf_overrides"] = {**overrides, **dict(args.get("hf_overrides") or {})}
        r.engine_kwargs["engine_args"] = args
    elif r.name == "sglang":
        args = dict(r.engine_kwargs.get("server_args") or {})
        given = json.loads(args.get("json_model_override_args") or "{}")
        args["json_model_override_args"] = json.dumps({**overrides, **given})
        r.engine_kwargs["server_args"] = args
