"""MathReward on real tokenized batches: scores, format reward, info, errors, threads, its config and entry point."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from hybridrl_math_reward import MathReward
from transformers import PreTrainedTokenizerBase

from hybridrl.batch import RolloutBatch
from hybridrl.registry import PluginConfigError, Registry
from hybridrl.testing import check_reward_manager

BatchOf = Callable[..., RolloutBatch]


def test_keeps_the_reward_manager_contract(tokenizer: PreTrainedTokenizerBase) -> None:
    check_reward_manager(MathReward, tokenizer=tokenizer)
    check_reward_manager(MathReward, config=MathReward.Config(extract="gsm8k", format_reward=0.5), tokenizer=tokenizer,
                         later_ctx_key="accepted")  # a context key of a later hybridrl does not break it


def test_scores_format_reward_and_info(tokenizer: PreTrainedTokenizerBase, batch_of: BatchOf) -> None:
    eos = tokenizer.eos_token
    batch = batch_of([
        (f"24 + 48 = 72\n#### 72{eos}", "72", "gsm8k"),  # right, in format, ended
        ("24 + 48 = 72\n#### 72", "72", "gsm8k"),  # right, in format, cut by the length limit
        (f"so she has 72 clips{eos}", "72", "gsm8k"),  # right by the last-number fallback: not in format
        (f"#### 71{eos}", "72", "gsm8k"),  # wrong, in format
        (f"I cannot tell.{eos}", "72", "gsm8k"),  # no answer
        (f"so $x=\\boxed{{\\dfrac{{1}}{{2}}}}${eos}", "0.5", "math"),  # right, boxed, ended
        (f"The answer is $\\frac12$.{eos}", "0.5", "math"),  # right by math-verify's extraction: not in format
        (f"\\boxed{{3}} is the answer{eos}<|endoftext|>junk \\boxed{{2}}", "3", "math"),  # text stops at EOS
    ])
    config = MathReward.Config(correct_score=1.0, wrong_score=-0.5, format_score=-1.0, format_reward=0.25)
    out = MathReward(config, tokenizer=tokenizer)(batch)
    assert out.scores_B.dtype == torch.float32 and out.scores_B.shape == (8,)
    assert out.scores_B.tolist() == [1.25, 1.0, 1.0, -0.25, -1.0, 1.25, 1.0, 1.25]
    assert out.correct_B is not None
    assert out.correct_B.tolist() == [True, True, True, False, False, True, True, True]
    assert out.info["has_answer"] == [True, True, True, True, False, True, True, True]
    assert out.info["extracted"] == ["72", "72", "72", "71", None, "\\dfrac{1}{2}", "\\frac{1}{2}", "3"]


def test_a_sample_without_ground_truth_is_an_error(tokenizer: PreTrainedTokenizerBase, batch_of: BatchOf) -> None:
    batch = batch_of([("#### 1", "1", "gsm8k"), ("#### 2", None, "gsm8k")])
    with pytest.raises(ValueError, match=r"sample 1 has no ground truth.*data\.ground_truth_key"):
        MathReward(MathReward.Config(), tokenizer=tokenizer)(batch)


def test_scores_off_the_main_thread(tokenizer: PreTrainedTokenizerBase, batch_of: BatchOf) -> None:
    """math-verify's default timeouts use signal.alarm, which raises off the main thread; the trainer scores
    in a worker thread, so the same batch must score the same there."""
    eos = tokenizer.eos_token
    batch = batch_of([(f"\\boxed{{\\sqrt{{2}}/2}}{eos}", "\\frac{\\sqrt2}{2}", "math"),
                      (f"#### 1,000{eos}", "1000", "gsm8k"), (f"\\boxed{{(1,2]}}{eos}", "(1,2)", "math")])
    reward = MathReward(MathReward.Config(), tokenizer=tokenizer)
    on_main = reward(batch)
    box: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: box.update(out=reward(batch)))
    worker.start()
    worker.join(60)
    assert not worker.is_alive() and "out" in box
    with ThreadPoolExecutor(max_workers=2) as pool:
        pooled = list(pool.map(reward, [batch, batch]))
    assert on_main.correct_B is not None and on_main.correct_B.tolist() == [True, True, False]
    for out in (box["out"], *pooled):
        assert torch.equal(out.scores_B, on_main.scores_B) and out.info == on_main.info


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"extract": "latex"}, r"extract='latex' is not valid; valid: \['auto', 'gsm8k', 'boxed', 'last_number'\]"),
    ({"correct_score": float("nan")}, "correct_score=nan must be a finite number"),
    ({"format_reward": float("inf")}, "format_reward=inf must be a finite number"),
    ({"max_answer_chars": 0}, "max_answer_chars=0 must be >= 1"),
])
def test_config_rejects_bad_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MathReward.Config(**kwargs)


def test_the_installed_entry_point_resolves(tokenizer: PreTrainedTokenizerBase) -> None:
    registry = Registry("reward_managers")
    entry = registry.entry("math", key="reward.name")
    assert (entry.distribution, entry.version, entry.value) == ("hybridrl-math-reward", "0.1.0",
                                                                 "hybridrl_math_reward:MathReward")
    assert registry.load("math") is MathReward
    reward = registry.build("math", {"extract": "gsm8k", "format_reward": 0.1}, key="reward.kwargs",
                            tokenizer=tokenizer)
    assert isinstance(reward, MathReward)
    assert reward.config.extract == "gsm8k"
    with pytest.raises(PluginConfigError, match=r"reward\.kwargs\.extract='latex'.*one of 'auto', 'gsm8k'"):
        registry.make_config("math", {"extract": "latex"}, key="reward.kwargs")
