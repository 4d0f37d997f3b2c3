"""Loss aggregation modes against hand-computed values, and micro-batch accumulation."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algorithms.loss_agg import LOSS_AGG_MODES, aggregate, local_normalizer

LOSS_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK_BT = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is empty


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7.0 / 3.0),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", 2.75),  # ((1 + 2) / 2 + 4 / 1) / 2 non-empty sequences = (1.5 + 4) / 2
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2 non-empty sequences
    ],
)
def test_modes(mode: str, expected: float) -> None:
    torch.testing.assert_close(aggregate(LOSS_BT, MASK_BT, mode), torch.tensor(expected))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_sum_to_the_mini_batch_loss_with_a_global_normalizer(mode: str) -> None:
    loss_BT = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    mask_BT = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    micro = [slice(0, 2), slice(2, 3), slice(3, 6)]
    total = torch.stack([local_normalizer(mask_BT[s], mode) for s in micro]).sum()
    summed = torch.stack([aggregate(loss_BT[s], mask_BT[s], mode, global_normalizer=total) for s in micro]).sum()
    torch.testing.assert_close(summed, aggregate(loss_BT, mask_BT, mode))
    # without it, micro-batch means do not add up (the point of the normaliser)
    naive = torch.stack([aggregate(loss_BT[s], mask_BT[s], mode) for s in micro]).mean()
    assert not torch.isclose(naive, aggregate(loss_BT, mask_BT, mode))


def test_empty_mask_gives_zero() -> None:
    for mode in LOSS_AGG_MODES:
        assert aggregate(LOSS_BT, torch.zeros(3, 3), mode).item() == 0.0


def test_invalid_mode_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        aggregate(LOSS_BT, MASK_BT, "token_mean")
