"""How a multi-turn sample is scored: ``reward.name``'s score of the policy's last turn plus the episode's environment
rewards (``SampleMeta.env_reward``); a sample whose environment failed scores 0 and counts as an error; the
``environment`` reward adds nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridrl.rewards.arithmetic import ArithmeticReward
from hybridrl.rewards.environment import EnvironmentReward
from hybridrl.rewards.execution import RewardConfig, RewardRunner, with_env_rewards
from hybridrl.testing import check_reward_manager


def _multi_turn(batch, tok, turns: list[list[tuple[str, int]]]):
    """``batch`` with each sample's response rebuilt from ``(text, trained)`` pieces: loss_mask 1 on trained text."""
    for b, pieces in enumerate(turns):
        ids, mask = [], []
        for text, trained in pieces:
            piece = tok(text.replace("<eos>", tok.eos_token), add_special_tokens=False)["input_ids"]
            ids, mask = ids + piece, mask + [trained] * len(piece)
        batch.response_ids[b, :] = tok.pad_token_id
        batch.response_ids[b, :len(ids)], batch.response_mask[b, :] = torch.tensor(ids), 0
        batch.response_mask[b, :len(ids)] = 1
        batch.loss_mask[b, :] = 0
        batch.loss_mask[b, :len(ids)] = torch.tensor(mask)
    return batch


def test_arithmetic_reads_the_policy_s_last_turn(make_batch, tok) -> None:
    batch = make_batch(["x" * 160] * 3, ["408", "408", "46"])
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call><eos>'
    reply = "\n<|im_start|>tool\n408<eos>\n<|im_start|>assistant\n"
    _multi_turn(batch, tok, [[(call, 1), (reply, 0), ("408<eos>", 1)], [(call, 1), (reply, 0), ("7<eos>", 1)],
                             [("46<eos>", 1)]])
    out = ArithmeticReward(ArithmeticReward.Config(), tokenizer=tok)(batch)
    # the tool's reply (408) is not the answer of sample 1; a single-turn response is its own last turn
    assert out.correct_B.tolist() == [True, False, True]


def test_environment_rewards_add_to_the_score_and_a_failed_environment_scores_zero(make_batch, tok) -> None:
    batch = make_batch(["46<eos>"] * 4, ["46"] * 4)
    batch.meta = [dataclasses.replace(m, env_reward=r, env_error=e) for m, r, e in
                  zip(batch.meta, [0.5, None, -1.0, 2.0], [None, None, None, "step() raised"], strict=True)]
    runner = RewardRunner.build(RewardConfig(name="arithmetic", on_error="zero"), tokenizer=tok, tokenizer_path="")
    scored = runner.score(batch)
    assert scored.output.scores_B.tolist() == [1.5, 1.0, 0.0, 0.0] and scored.errors == 1
    assert scored.output.correct_B.tolist() == [True, True, True, False]
    plain = make_batch(["46<eos>"], ["46"])  # no environment: the plugin's own output, untouched
    out = runner.score(plain).output
    assert with_env_rewards(out, plain) is out and out.scores_B.tolist() == [1.0]


def test_the_environment_reward_is_the_environment_s_alone(make_batch, tok) -> None:
    check_reward_manager(EnvironmentReward, tokenizer=tok)
    batch = make_batch(["3<eos>", "46<eos>"], ["46", "46"])
    batch.meta = [dataclasses.replace(m, env_reward=r) for m, r in zip(batch.meta, [0.0, 1.0], strict=True)]
    runner = RewardRunner.build(RewardConfig(name="environment"), tokenizer=tok, tokenizer_path="")
    assert runner.score(batch).output.scores_B.tolist() == pytest.approx([0.0, 1.0])
