"""KeywordReward on hand-made batches, and built through the plugin registry."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from hybridrl.batch import RolloutBatch
from hybridrl.registry import PluginConfigError, Registry
from hybridrl.rewards.keyword import KeywordReward

RESPONSES = ["The answer is 4. Done<eos>", "answer: unknown", "nothing here<eos>"]

MakeBatch = Callable[..., RolloutBatch]  # the make_batch fixture of conftest.py


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("fraction", [1.0, 0.5, 0.0]), ("any", [1.0, 1.0, 0.0]), ("all", [1.0, 0.0, 0.0])],
)
def test_modes(make_batch: MakeBatch, tok: PreTrainedTokenizerBase, mode: str, expected: list[float]) -> None:
    reward = KeywordReward(KeywordReward.Config(keywords=["answer", "done"], mode=mode),  # type: ignore[arg-type]
                           tokenizer=tok)
    out = reward(make_batch(RESPONSES))
    torch.testing.assert_close(out.scores_B, torch.tensor(expected))
    assert out.info == {"matched": [2, 1, 0]}
    assert out.correct_B is not None and out.correct_B.tolist() == [True, False, False]


def test_case_sensitivity_scale_and_special_tokens(make_batch: MakeBatch, tok: PreTrainedTokenizerBase) -> None:
    reward = KeywordReward(KeywordReward.Config(keywords=["Done", "im_end"], case_sensitive=True, scale=2.0),
                           tokenizer=tok)
    out = reward(make_batch(RESPONSES))
    assert out.scores_B.tolist() == [1.0, 0.0, 0.0]  # "<|im_end|>" is not text


def test_registry_builds_it_and_validates(tok: PreTrainedTokenizerBase) -> None:
    registry = Registry("reward_managers")
    reward = registry.build("keyword", {"keywords": ["a"], "mode": "any"}, key="reward.kwargs", tokenizer=tok)
    assert isinstance(reward, KeywordReward)
    with pytest.raises(PluginConfigError, match=r"missing required key reward\.kwargs\.keywords"):
        registry.build("keyword", {}, key="reward.kwargs", tokenizer=tok)
    with pytest.raises(PluginConfigError, match=r"reward\.kwargs\.mode='most'"):
        registry.build("keyword", {"keywords": ["a"], "mode": "most"}, key="reward.kwargs", tokenizer=tok)
    with pytest.raises(ValueError, match=r"mode='most' is not valid; valid: \['fraction', 'any', 'all'\]"):
        KeywordReward.Config(keywords=["a"], mode="most")  # type: ignore[arg-type]
    with pytest.raises(PluginConfigError, match="keywords=\\[\\] must be a non-empty list"):
        registry.build("keyword", {"keywords": []}, key="reward.kwargs", tokenizer=tok)
