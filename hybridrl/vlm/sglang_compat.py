"""Workaround: importing SGLang breaks transformers' own Qwen2.5-VL in the same process.

SGLang 0.5.21 patches ``transformers.PretrainedConfig.standardize_rope_params`` when it is imported
(``sglang.srt.utils.hf_transformers_patches._patch_rope_parameters_validation``) to return early on any config without
``max_position_embeddings``. Qwen2.5-VL's vision config has none, so its RoPE parameters are never standardised: its
``rope_type`` stays ``default`` instead of ``axial``, and transformers' vision tower then refuses to build
("Qwen2_5_VLVisionRotaryEmbedding supports only axial rope, but requested default"). Any process that has started an
SGLang engine (a trainer with ``rollout.name=sglang``, a test worker) hits it.

:func:`transformers_rope_rules` restores transformers' own method while a block builds or loads a Qwen2.5-VL config
or model, and puts SGLang's back after (SGLang's engine relies on it for its configs).
``tests/vlm/test_vlm_sglang_compat.py`` shows it is still needed: it fails once SGLang's patch no longer changes the
vision config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def transformers_rope_rules() -> Iterator[None]:
    """Inside: ``PretrainedConfig.standardize_rope_params`` is transformers' own (a no-op without SGLang's patch)."""
    from transformers import PretrainedConfig
    from transformers.modeling_rope_utils import RotaryEmbeddingConfigMixin

    patched = PretrainedConfig.__dict__.get("standardize_rope_params")
    original = RotaryEmbeddingConfigMixin.__dict__.get("standardize_rope_params")
    if patched is None or original is None or patched is original:
        yield
        return
    PretrainedConfig.standardize_rope_params = original  # type: ignore[method-assign]
    try:
        yield
    finally:
        PretrainedConfig.standardize_rope_params = patched  # type: ignore[method-assign]
