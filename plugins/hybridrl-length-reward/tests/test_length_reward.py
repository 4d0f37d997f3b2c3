"""LengthReward: hybridrl's contract kit on a real batch, its scores, and its config checks."""

from __future__ import annotations

import pytest
import torch
from hybridrl_length_reward import LengthReward

from hybridrl.testing import check_reward_manager, make_batch, tiny_tokenizer


def test_keeps_the_reward_contract() -> None:
    check_reward_manager(LengthReward, config=LengthReward.Config(target_length=4), tokenizer=tiny_tokenizer())


def test_scores_correct_and_info() -> None:
    tok = tiny_tokenizer()  # one token per char
    batch = make_batch(tok, prompts=["hi"], ground_truths=None, responses=[["abcd", "abc", "abcdefghi"]])
    out = LengthReward(LengthReward.Config(target_length=4, scale=2.0, min_score=-1.0), tokenizer=tok)(batch)
    torch.testing.assert_close(out.scores_B, torch.tensor([0.0, -0.5, -1.0]))  # -2.5 clipped at min_score
    assert out.correct_B is not None and out.correct_B.tolist() == [True, False, False]
    assert out.info == {"length": [4.0, 3.0, 9.0]}


@pytest.mark.parametrize(("kwargs", "message"),
                         [({"target_length": 0}, "target_length=0"), ({"scale": 0.0}, "scale=0.0")])
def test_config_rejects_bad_values(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LengthReward.Config(**kwargs)  # type: ignore[arg-type]
