"""What an RL run of a vision-language model meets today (issue 46): the checks, before anything is built.

The policy's first stage runs the vision tower and each row gets multimodal positions in padded micro-batches
(:mod:`hybridrl.vlm.megatron_vlm`); the prompts' images reach an engine that takes them (``supports_images``). Each
refusal below names what does not carry images yet and what to set instead.
"""

from __future__ import annotations

from typing import Any

from hybridrl.config.schema import RLConfig
from hybridrl.hf.arch import HFArch
from hybridrl.megatron.stages import FIRST, PipelineSplit, stage_sizes
from hybridrl.registry import PluginError, Registry

AOR = "actor_rollout_ref"


def vlm_layout(cfg: RLConfig, model: HFArch | None) -> list[str]:
    """Turn what a VLM run cannot use yet but can run without into its fallback, in ``cfg`` (validation's derived
    copy, which the run uses); returns the notes that say so. ``megatron.sequence_parallel`` (on in verl's Megatron
    recipes) goes off: the image features enter the embeddings before sequence parallelism would scatter them — the
    same result, with each TP rank holding the whole sequence's activations between layers. With LoRA the vision
    tower is frozen (the base model is)."""
    if model is None or model.vision is None:
        return []
    notes = []
    actor = cfg.actor_rollout_ref.actor
    if cfg.actor_rollout_ref.model.lora_rank > 0 and not actor.freeze_vision_tower:
        actor.freeze_vision_tower = True
        notes.append(f"{AOR}.model.lora_rank > 0 on a vision-language model: adapters on the language model's "
                     f"projections, the vision tower frozen with the base weights ({AOR}.actor.freeze_vision_tower "
                     "is true), as peft freezes every base weight")
    for role in ("actor", "ref"):
        m = getattr(cfg.actor_rollout_ref, role).megatron
        if m.sequence_parallel:
            m.sequence_parallel = False
            notes.append(f"{AOR}.{role}.megatron.sequence_parallel=true is off for a vision-language model (image "
                         "features enter the embeddings before it would scatter them): the same result, more "
                         "activation memory per TP rank")
    return notes


def vlm_problems(cfg: RLConfig, model: HFArch | None, *, planning: bool) -> list[tuple[str, Any, str]]:
    """``(key, value, message)`` for each setting a VLM run cannot take."""
    if model is None or model.vision is None:
        return []
    aor, out = cfg.actor_rollout_ref, []
    r = aor.rollout
    try:
        engine = Registry("rollout_engines").load(r.name, key=f"{AOR}.rollout.name")
    except PluginError:  # reported by check_plugins
        engine = None
    if engine is not None and not getattr(engine, "supports_images", False) and not planning:
        out.append((f"{AOR}.rollout.name", r.name, "this engine does not take images; a vision-language model "
                    "needs one that does (hf, vllm, sglang)"))
    # megatron.use_remove_padding and a null use_prefix_grouper fall back to padded rows (batch_plan): packed rows
    # give RoPE one position table per sequence, which multimodal positions do not fit; CP splits padded rows
    out += _deepstack_problems(cfg, model)
    refusals = (
        (f"{AOR}.actor.use_prefix_grouper", aor.actor.use_prefix_grouper, aor.actor.use_prefix_grouper is True,
         "shared-prompt rows carry no multimodal positions; set it to false"),
        (f"{AOR}.rollout.placement", r.placement, r.placement != "colocated",
         "engines on ranks of their own do not receive images yet; use colocated"),
        (f"{AOR}.teacher.model.path", aor.teacher.model.path, aor.teacher.enabled,
         "a distillation teacher does not score images yet; leave it null"),
        ("data.apply_chat_template", cfg.data.apply_chat_template, not cfg.data.apply_chat_template,
         "the processor's chat template renders a prompt's image parts; set it to true"),
        ("critic.enable", cfg.critic.enable, bool(cfg.critic.enable) or cfg.algorithm.adv_estimator == "gae",
         "the critic has no vision tower yet; use a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...)"),
    )
    for key, value, refused, fix in refusals:
        if refused:
            out.append((key, value, f"not with a vision-language model yet: {fix}"))
    return out


def _deepstack_problems(cfg: RLConfig, model: HFArch) -> list[tuple[str, Any, str]]:
    """Qwen3-VL's DeepStack adds image features after decoder layers 0..k-1, on the stage that runs the tower (the
    first pipeline stage's first model chunk): a split that puts fewer layers there cannot run it."""
    k = model.vision.deepstack_layers if model.vision is not None else 0
    m = cfg.actor_rollout_ref.actor.megatron  # the reference is built on the actor's stage split
    first, last = stage_sizes(m.override_transformer_config)
    split = PipelineSplit(num_layers=model.num_layers, pp=max(m.pipeline_model_parallel_size, 1),
                          vpp=m.virtual_pipeline_model_parallel_size, first=first, last=last)
    if not k or split.problems():  # a bad split is reported as such
        return []
    held = len(split.layers(0)[0])
    if held >= k:
        return []
    return [(f"{AOR}.actor.megatron.override_transformer_config.{FIRST}", first,
             f"the first pipeline stage's first chunk holds {held} decoder layer(s), but this model's DeepStack adds "
             f"image features after layers 0..{k - 1} on the stage that runs the vision tower: set it to at least "
             f"{k} (or use fewer pipeline stages / chunks)")]
