"""The VLM tests build and load transformers' Qwen2.5-VL: with transformers' own RoPE rules, whatever another test of
the worker process imported before (SGLang patches them: :mod:`hybridrl.vlm.sglang_compat`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hybridrl.vlm.sglang_compat import transformers_rope_rules


@pytest.fixture(autouse=True)
def _transformers_rope_rules() -> Iterator[None]:
    with transformers_rope_rules():
        yield
