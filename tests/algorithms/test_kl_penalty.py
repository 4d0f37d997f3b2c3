"""KL estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridrl.algorithms.kl import kl_penalty

# token 0: logprob -1, ref -2 -> log_r = 1;  token 1: logprob -2, ref -1 -> log_r = -1
LOGP_BT = torch.tensor([[-1.0, -2.0]])
REF_BT = torch.tensor([[-2.0, -1.0]])


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("k1", "kl"), [1.0, -1.0]),
        (("k2", "mse"), [0.5, 0.5]),  # 0.5 * 1^2
        # k3 = exp(-log_r) + log_r - 1: exp(-1) + 1 - 1 = 0.367879; exp(1) - 1 - 1 = 0.718282
        (("k3", "low_var_kl"), [math.exp(-1.0), math.e - 2.0]),
        (("abs",), [1.0, 1.0]),
    ],
)
def test_estimators(kinds: tuple[str, ...], expected: list[float]) -> None:
    for kind in kinds:
        torch.testing.assert_close(kl_penalty(LOGP_BT, REF_BT, kind), torch.tensor([expected]))


def test_k3_is_clamped_like_verl() -> None:
    # log_r = 30: -log_r clamps to -20, exp(-20) + 20 - 1 = 19.0000..., clamped to 10
    kl = kl_penalty(torch.tensor([0.0]), torch.tensor([-30.0]), "k3")
    torch.testing.assert_close(kl, torch.tensor([10.0]))


def test_gradient_reaches_logprobs() -> None:
    logp_BT = LOGP_BT.clone().requires_grad_(True)
    kl_penalty(logp_BT, REF_BT, "k2").sum().backward()
    assert logp_BT.grad is not None
    torch.testing.assert_close(logp_BT.grad, torch.tensor([[1.0, -1.0]]))  # d(0.5 x^2)/dx = x


def test_invalid_kind_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: k1, kl, k2, mse, k3, low_var_kl, abs"):
        kl_penalty(LOGP_BT, REF_BT, "k4")
