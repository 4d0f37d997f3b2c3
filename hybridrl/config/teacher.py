"""Static checks of the on-policy distillation teacher (``actor_rollout_ref.teacher``), before any model is built.

The teacher exists exactly when the advantage estimator needs one (``needs_teacher``: ``opd``, ``grpo_opd``) or the
actor's loss has a distillation term (``actor_rollout_ref.teacher.loss``, checked here too); its
checkpoint is read like the actor's (``build_if_missing`` included); it runs in the actor's Megatron layout, so its
architecture must split as the actor's does; and it scores the student's token ids, so its tokenizer must be the
student's (the same vocabulary) — a teacher of another tokenizer is refused here, not at step 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hybridrl import bootstrap
from hybridrl.hf.arch import HFArch, inspect_model_dir
from hybridrl.megatron.stages import stage_sizes

if TYPE_CHECKING:
    from hybridrl.config.schema import RLConfig

AOR = "actor_rollout_ref"
KEY = f"{AOR}.teacher"
Problem = tuple[str, object, str]


def estimator_needs_teacher(name: str) -> bool | None:
    """Whether ``algorithm.adv_estimator=name`` needs a teacher (None: not installed; validation names it)."""
    from hybridrl.registry import PluginError, Registry

    try:
        return bool(Registry("advantage_estimators").load(name).needs_teacher)
    except PluginError:
        return None


def loss_problems(cfg: RLConfig) -> list[Problem]:
    """``actor_rollout_ref.teacher.loss``'s own fields (the supervised distillation term)."""
    loss = cfg.actor_rollout_ref.teacher.loss
    return [(f"{KEY}.loss.{name}", value, message) for name, value, message in loss.problems()]


def _needs_problems(cfg: RLConfig) -> list[Problem]:
    """Whether there should be a teacher: exactly when the estimator distills (opd, grpo_opd) or the actor's loss has
    a distillation term (``teacher.loss.loss_mode``)."""
    t, name = cfg.actor_rollout_ref.teacher, cfg.algorithm.adv_estimator
    needs, mode = estimator_needs_teacher(name), t.loss.loss_mode
    if not t.enabled:
        if needs or mode is not None:
            why = (f"algorithm.adv_estimator={name!r} distills from a teacher" if needs
                   else f"{KEY}.loss.loss_mode={mode} distills from a teacher")
            return [(f"{KEY}.model.path", None, f"{why}: set it to the teacher's HF checkpoint (its tokenizer must "
                     "be the student's)")]
        return []
    if needs is False and mode is None:
        return [(f"{KEY}.model.path", t.model.path, f"algorithm.adv_estimator={name!r} does not use a teacher and "
                 f"{KEY}.loss.loss_mode is null: it would be built for nothing; set it to null, or use a distillation "
                 "estimator (opd, grpo_opd) or a distillation loss (loss.loss_mode: forward_kl_topk, k1, k3, ...)")]
    return []


def teacher_model(cfg: RLConfig, *, before_bootstrap: bool) -> tuple[HFArch | None, list[Problem]]:
    """The teacher's architecture (None: no teacher, or not readable yet) and the problems of its checkpoint, of its
    loss and of whether there should be one at all."""
    t = cfg.actor_rollout_ref.teacher
    problems = loss_problems(cfg) + _needs_problems(cfg)
    if not t.enabled:
        return None, problems
    m = t.model
    assert m.path is not None
    if (p := bootstrap.kind_problem(m.build_if_missing, model=True)) is not None:
        problems.append((f"{KEY}.model.build_if_missing", m.build_if_missing, p))
    if (p := bootstrap.outside_cache_problem(m.build_if_missing, m.path)) is not None:
        return None, [*problems, (f"{KEY}.model.path", m.path, p)]
    if before_bootstrap and bootstrap.will_build(m.build_if_missing, m.path, model=True):
        return None, problems
    arch, found = inspect_model_dir(m.path, tokenizer_path=m.tokenizer_path)
    for p in found:
        tok = m.tokenizer_path is not None and "tokenizer" in p
        problems.append((f"{KEY}.model.tokenizer_path" if tok else f"{KEY}.model.path",
                         m.tokenizer_path if tok else m.path, p))
    return arch, problems


def planned_teacher(cfg: RLConfig, config: Path | None, student: HFArch | None, *,
                    notes: list[str]) -> tuple[HFArch | None, list[Problem]]:
    """The teacher's architecture when planning a run for another machine (``--model-config``): from ``config`` (its
    config.json), else its checkpoint's when that is here, else the student's (a note says so: the memory plan counts
    the teacher either way). Whether there should be a teacher at all is checked as for a run."""
    t = cfg.actor_rollout_ref.teacher
    if not t.enabled:
        return teacher_model(cfg, before_bootstrap=True)
    problems = loss_problems(cfg) + _needs_problems(cfg)
    assert t.model.path is not None
    local = Path(t.model.path) / "config.json"
    source = config if config is not None else local if local.is_file() else None
    if source is None:
        notes.append(f"teacher planned with the student's architecture ({KEY}.model.path={t.model.path} is not here; "
                     "hybridrl validate --teacher-config <its config.json> plans it with its own)")
        return student, problems
    try:
        return HFArch.from_hf(source), problems
    except (OSError, KeyError, ValueError, NotImplementedError) as e:
        return None, [*problems, ("--teacher-config", str(source), str(e))]


def teacher_layout_problems(cfg: RLConfig, teacher: HFArch | None) -> list[Problem]:
    """The teacher shares the actor's process groups: its explicit sizes equal the actor's, its architecture splits
    over them; its top-k fits its vocabulary."""
    t, actor = cfg.actor_rollout_ref.teacher, cfg.actor_rollout_ref.actor.megatron
    topk: list[Problem] = (
        [(f"{KEY}.loss.topk", t.loss.topk, f"at most the teacher's vocabulary ({teacher.vocab_size} tokens)")]
        if teacher is not None and t.loss.uses_topk and t.loss.topk > teacher.vocab_size else [])
    if t.inference.on_engine:  # on engines of its own: their checks are inference_problems'
        return topk
    out: list[Problem] = topk + [
        (f"{KEY}.megatron.{size}", mine, f"must equal {AOR}.actor.megatron.{size}={theirs} (the teacher shares the "
         "actor's Megatron process groups); leave it null to follow the actor")
        for size, mine, theirs in t.megatron.mismatches(actor)]
    if teacher is not None:
        first, last = stage_sizes(actor.override_transformer_config)  # the teacher is built on the actor's split
        out += [(f"{AOR}.actor.megatron.{size}", value, f"{KEY}.model.path: {message}")
                for size, value, message in teacher.split_problems(
                    tp=max(actor.tensor_model_parallel_size, 1), pp=max(actor.pipeline_model_parallel_size, 1),
                    vpp=actor.virtual_pipeline_model_parallel_size, ep=max(actor.expert_model_parallel_size, 1),
                    first=first, last=last)]
    return out


def tokenizer_problems(cfg: RLConfig) -> list[Problem]:
    """The teacher's tokenizer must give every token id the student's meaning: the same vocabulary, added tokens
    included (its special-token choices, e.g. an instruct model's EOS, may differ: the teacher only scores ids).
    Loads both tokenizers (files only, no model)."""
    from transformers import AutoTokenizer

    aor = cfg.actor_rollout_ref
    t = aor.teacher.model
    assert t.path is not None
    student_path, teacher_path = aor.model.tokenizer_path or aor.model.path, t.tokenizer_path or t.path
    key = f"{KEY}.model.tokenizer_path" if t.tokenizer_path else f"{KEY}.model.path"
    try:
        student, teacher = AutoTokenizer.from_pretrained(student_path), AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError) as e:
        return [(key, teacher_path, f"its tokenizer (or the student's at {student_path}) does not load: {e}")]
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        differ = sorted(set(sv.items()) ^ set(tv.items()), key=lambda kv: kv[1])[:3]
        return [(key, teacher_path, f"its tokenizer is not the student's ({student_path}): vocabularies of "
                 f"{len(tv)} and {len(sv)} tokens, differing at e.g. {differ}; the teacher must score the student's "
                 "token ids, so distill from a teacher with the student's tokenizer")]
    return []


def inference_problems(cfg: RLConfig, *, world: int, ranks_per_node: int, device_type: str,
                       teacher: HFArch | None) -> list[Problem]:
    """The teacher on engine ranks of its own (``teacher.inference.name`` set): an installed engine plugin that can
    score sequences, with a valid ``engine_kwargs``, on ``num_ranks`` ranks that split into whole engines on one
    node each and leave ranks to train; its TP divides the teacher's heads; the engine can serve the checkpoint."""
    from hybridrl.registry import PluginError, Registry

    t = cfg.actor_rollout_ref.teacher
    i, key = t.inference, f"{KEY}.inference"
    if not t.enabled or not i.on_engine:
        return []
    out: list[Problem] = []
    registry = Registry("rollout_engines")
    try:
        cls = registry.load(i.name, key=f"{key}.name")
    except PluginError as e:
        return [(f"{key}.name", i.name, str(e))]
    if not callable(getattr(cls, "score", None)):
        scoring = [n for n in registry.names() if callable(getattr(_load(registry, n), "score", None))]
        out.append((f"{key}.name", i.name, f"the {i.name} engine cannot score sequences (its plugin has no "
                    f"`score`), so it cannot serve a teacher; engines that can: {', '.join(scoring)}; or null (the "
                    "teacher in Megatron on the trainer ranks)"))
    try:
        registry.make_config(i.name, i.engine_kwargs, key=f"{key}.engine_kwargs")
    except PluginError as e:
        out.append((f"{key}.engine_kwargs", i.engine_kwargs, str(e)))
    tp, n = i.tensor_model_parallel_size, i.num_ranks
    if tp < 1:
        return [*out, (f"{key}.tensor_model_parallel_size", tp, "must be ≥ 1")]
    if tp > 1 and not getattr(cls, "supports_tensor_parallel", False):
        out.append((f"{key}.tensor_model_parallel_size", tp, f"the {i.name} engine has no tensor parallelism: 1"))
    if not 1 <= n < world:
        out.append((f"{key}.num_ranks", n, f"must be 1..{world - 1}: the last num_ranks of the {world} launched "
                    "ranks serve the teacher and at least one must train (launch more ranks: trainer.n_gpus_per_node "
                    "counts both)"))
    elif n % tp:
        out.append((f"{key}.num_ranks", n, f"must be a multiple of {key}.tensor_model_parallel_size={tp} (one "
                    "engine per TP group of teacher ranks)"))
    else:
        first = world - n
        crossing = [g for g in range(first, world, tp) if g // ranks_per_node != (g + tp - 1) // ranks_per_node]
        if crossing:
            where = f"{crossing[0]}..{crossing[0] + tp - 1}"
            out.append((f"{key}.num_ranks", n, f"puts the teacher engine of ranks {where} "
                        f"on two nodes ({ranks_per_node} ranks per node): an engine's devices are on one node"))
    if teacher is not None and teacher.num_attention_heads % tp:
        out.append((f"{key}.tensor_model_parallel_size", tp, f"must divide the teacher's "
                    f"{teacher.num_attention_heads} attention heads"))
    r = cfg.actor_rollout_ref.rollout
    if not getattr(cls, "scores_tempered", True) and r.temperature not in (0.0, 1.0):
        out.append((f"{AOR}.rollout.temperature", r.temperature, f"the {i.name} engine scores a teacher's tokens "
                    f"under the untempered softmax only, and the actor's log-probs are tempered by it: 1.0 (or 0), "
                    "or another teacher engine (hf, or null: Megatron)"))
    if not 0 < i.gpu_memory_utilization <= 1:
        out.append((f"{key}.gpu_memory_utilization", i.gpu_memory_utilization, "a share of each GPU: in (0, 1]"))
    model_problem = getattr(cls, "model_problem", None)
    if callable(model_problem) and t.model.path is not None and (Path(t.model.path) / "config.json").is_file():
        if (problem := model_problem(t.model.path, device_type=device_type)) is not None:
            out.append((f"{key}.name", i.name, problem))
    return out


def _load(registry: object, name: str) -> object:
    from hybridrl.registry import PluginError

    try:
        return registry.load(name)  # type: ignore[attr-defined]
    except PluginError:
        return None
