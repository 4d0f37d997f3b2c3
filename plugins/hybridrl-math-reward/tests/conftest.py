"""Fixtures for the tests of hybridrl-math-reward, which run against the *installed* package.

Nothing here puts this checkout on ``sys.path``: ``import hybridrl_math_reward`` and the ``math`` entry
point come from ``pip install ./plugins/hybridrl-math-reward``, as a user (and CI) gets them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from importlib import metadata

import pytest
from transformers import PreTrainedTokenizerBase

from hybridrl.batch import RolloutBatch
from hybridrl.models.char_tokenizer import make_char_tokenizer
from hybridrl.testing import make_batch

try:
    metadata.distribution("hybridrl-math-reward")
except metadata.PackageNotFoundError as e:
    raise ImportError("hybridrl-math-reward is not installed, and its tests check the installed package and its "
                      "entry point: pip install ./plugins/hybridrl-math-reward") from e


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    """hybridrl's char tokenizer (one token per ASCII char; EOS ``<|im_end|>``), as tiny models use."""
    return make_char_tokenizer(model_max_length=4096)


@pytest.fixture
def batch_of(tokenizer: PreTrainedTokenizerBase) -> Callable[[Sequence[tuple[str, str | None, str]]], RolloutBatch]:
    """``batch_of([(response, ground_truth, data_source), ...])``: a real RolloutBatch, one prompt per sample.

    Responses are tokenized as written: ``tokenizer.eos_token`` in the text becomes the EOS token."""

    def make(samples: Sequence[tuple[str, str | None, str]]) -> RolloutBatch:
        batch = make_batch(tokenizer, prompts=[f"question {i}" for i in range(len(samples))],
                           ground_truths=[truth for _, truth, _ in samples],
                           responses=[[response] for response, _, _ in samples])
        sources = [source for _, _, source in samples]
        meta = [dataclasses.replace(m, data_source=s) for m, s in zip(batch.meta, sources, strict=True)]
        return dataclasses.replace(batch, meta=meta)

    return make
