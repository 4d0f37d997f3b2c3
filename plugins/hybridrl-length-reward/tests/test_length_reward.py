"""LengthReward on a hand-made batch: scores, ``correct_B``, info, its config checks and the protocol."""

from __future__ import annotations

import pytest
import torch
from hybridrl_length_reward import LengthReward

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.interfaces import RewardManager


def batch_of_lengths(lengths: list[int]) -> RolloutBatch:
    b, t = len(lengths), max(lengths)
    response_mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).long()
    return RolloutBatch(
        prompt_ids=torch.ones(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
        response_ids=response_mask * 7, response_mask=response_mask, rollout_logprobs=torch.zeros(b, t),
        weight_version=torch.zeros(b, dtype=torch.long), group_index=torch.arange(b),
        meta=[SampleMeta() for _ in range(b)], pad_token_id=0,
    )


def test_scores_correct_and_info() -> None:
    reward = LengthReward(LengthReward.Config(target_length=4, scale=2.0, min_score=-1.0))
    assert isinstance(reward, RewardManager)
    out = reward(batch_of_lengths([4, 3, 9]))
    torch.testing.assert_close(out.scores_B, torch.tensor([0.0, -0.5, -1.0]))  # -2.5 clipped at min_score
    assert out.correct_B is not None and out.correct_B.tolist() == [True, False, False]
    assert out.info == {"length": [4.0, 3.0, 9.0]}


@pytest.mark.parametrize(("kwargs", "message"),
                         [({"target_length": 0}, "target_length=0"), ({"scale": 0.0}, "scale=0.0")])
def test_config_rejects_bad_values(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LengthReward.Config(**kwargs)  # type: ignore[arg-type]
