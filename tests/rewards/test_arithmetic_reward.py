"""ArithmeticReward on hand-made batches, and built through the plugin registry."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardManager, RewardOutput
from hybridrl.registry import PluginConfigError, Registry
from hybridrl.rewards.arithmetic import ArithmeticReward

MakeBatch = Callable[..., RolloutBatch]  # the make_batch fixture of conftest.py


def correct(out: RewardOutput) -> list[bool]:
    assert out.correct_B is not None
    return out.correct_B.tolist()


def test_exact_match_before_eos(make_batch: MakeBatch, tok: PreTrainedTokenizerBase) -> None:
    reward = ArithmeticReward(ArithmeticReward.Config(format_score=-1.0, wrong_score=-0.5), tokenizer=tok)
    batch = make_batch(
        ["46<eos>", " 46 \n<eos>", "47<eos>", "46", "46<eos>99", "<eos>", "-3<eos>"],
        ["46", "46", "46", "46", "46", "0", " -3 "],
    )
    out = reward(batch)
    torch.testing.assert_close(out.scores_B, torch.tensor([1.0, 1.0, -0.5, -1.0, 1.0, -0.5, 1.0]))
    assert out.correct_B is not None and out.correct_B.dtype == torch.bool
    assert out.correct_B.tolist() == [True, True, False, False, True, False, True]
    assert out.info == {"has_answer": [True, True, True, False, True, True, True]}


def test_pad_token_also_ends_the_answer(make_batch: MakeBatch, tok: PreTrainedTokenizerBase) -> None:
    batch = make_batch(["12" + tok.pad_token], ["12"])
    out = ArithmeticReward(ArithmeticReward.Config(), tokenizer=tok)(batch)
    assert correct(out) == [True]


def test_no_strip_and_last_number(make_batch: MakeBatch, tok: PreTrainedTokenizerBase) -> None:
    strict = ArithmeticReward(ArithmeticReward.Config(strip=False), tokenizer=tok)
    assert correct(strict(make_batch([" 46<eos>", "46<eos>"], ["46", "46"]))) == [False, True]

    last = ArithmeticReward(ArithmeticReward.Config(extract="last_number"), tokenizer=tok)
    out = last(make_batch(["so 12+34 = 46<eos>", "it is -7", "none<eos>", "46<eos>1"],
                          ["46", "-7", "1", "46"]))
    assert correct(out) == [True, True, False, True]
    assert out.info["has_answer"] == [True, True, False, True]


def test_missing_ground_truth_names_the_config_key(make_batch: MakeBatch, tok: PreTrainedTokenizerBase) -> None:
    reward = ArithmeticReward(ArithmeticReward.Config(), tokenizer=tok)
    with pytest.raises(ValueError, match=r"sample 0 has no ground truth.*data\.ground_truth_key"):
        reward(make_batch(["1<eos>"]))


def test_registry_builds_it_and_rejects_bad_keys(make_batch: MakeBatch, tok: PreTrainedTokenizerBase) -> None:
    registry = Registry("reward_managers")
    reward = registry.build("arithmetic", {"correct_score": 2, "extract": "last_number"},
                            key="reward.kwargs", tokenizer=tok)
    assert isinstance(reward, ArithmeticReward) and isinstance(reward, RewardManager)
    assert reward.config.correct_score == 2
    assert reward(make_batch(["x 5<eos>"], ["5"])).scores_B.tolist() == [2.0]

    with pytest.raises(PluginConfigError, match=r"unknown key reward\.kwargs\.corect_score.*"
                                                r"Valid keys of 'arithmetic': correct_score: float"):
        registry.build("arithmetic", {"corect_score": 1.0}, key="reward.kwargs", tokenizer=tok)
    with pytest.raises(PluginConfigError, match=r"reward\.kwargs\.extract='first'"):
        registry.build("arithmetic", {"extract": "first"}, key="reward.kwargs", tokenizer=tok)
    with pytest.raises(ValueError, match=r"extract='first' is not valid; valid: \['before_eos', 'last_number'\]"):
        ArithmeticReward.Config(extract="first")  # type: ignore[arg-type]
