"""The critic's clipped value loss on hand-computed cases: ½·max((V−R)², (clip(V, V_old±ε)−R)²), token-mean."""

from __future__ import annotations

import pytest
import torch

from hybridrl.algorithms.loss_agg import local_normalizer
from hybridrl.algorithms.value_loss import clipped_value_loss


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_unclipped_term_wins_inside_or_towards_the_return() -> None:
    # token 0: V moved 1 away from V_old (ε 0.5) but the clipped value is further from R: (1−0)² = 1 > (0.5−0)²
    # token 1: V = V_old: both terms (2−3)² = 1
    loss, m = clipped_value_loss(t([1.0, 2.0]), t([0.0, 2.0]), t([0.0, 3.0]), t([1, 1]), cliprange=0.5)
    assert float(loss) == pytest.approx(0.5 * (1.0 + 1.0) / 2)
    assert float(m["vf_clipfrac"]) == 0.0 and float(m["vpred_mean"]) == pytest.approx(1.5)
    assert float(m["vf_loss_sum"]) == pytest.approx(float(loss))


def test_clipped_term_wins_and_stops_the_gradient() -> None:
    # V moved +1 from V_old = 0 towards R = 2: clipped value 0.5, (0.5−2)² = 2.25 > (1−2)² = 1
    values = t([1.0]).requires_grad_()
    loss, m = clipped_value_loss(values, t([0.0]), t([2.0]), t([1]), cliprange=0.5)
    assert float(loss) == pytest.approx(0.5 * 2.25) and float(m["vf_clipfrac"]) == 1.0
    loss.backward()
    assert values.grad is not None and float(values.grad[0, 0]) == 0.0  # clip(V) is flat outside V_old ± ε


def test_gradient_of_the_unclipped_term_is_v_minus_r() -> None:
    values = t([0.25, 0.0]).requires_grad_()
    loss, _ = clipped_value_loss(values, t([0.0, 0.0]), t([1.0, 0.0]), t([1, 0]), cliprange=0.5)
    loss.backward()
    assert values.grad is not None
    assert values.grad.tolist() == [[pytest.approx(0.25 - 1.0), 0.0]]  # d/dV ½(V−R)² over 1 token; mask: 0


def test_masked_tokens_do_not_count() -> None:
    values, old, returns = t([1.0, 100.0], [3.0, 0.0]), t([1.0, 0.0], [3.0, 0.0]), t([0.0, 0.0], [1.0, -50.0])
    mask = t([1, 0], [1, 0])
    loss, m = clipped_value_loss(values, old, returns, mask, cliprange=0.2)
    assert float(loss) == pytest.approx(0.5 * (1.0 + 4.0) / 2)  # 2 real tokens: (1−0)², (3−1)²
    assert float(m["vpred_mean"]) == pytest.approx(2.0) and float(m["vf_clipfrac"]) == 0.0


def test_micro_batches_sum_to_the_mini_batch_loss_with_the_global_normalizer() -> None:
    g = torch.Generator().manual_seed(0)
    values, old, returns = (torch.randn(6, 5, generator=g) for _ in range(3))
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    whole, _ = clipped_value_loss(values, old, returns, mask, cliprange=0.3)
    normalizer = local_normalizer(mask, "token-mean")
    parts = [clipped_value_loss(values[i:i + 2], old[i:i + 2], returns[i:i + 2], mask[i:i + 2], cliprange=0.3,
                                global_normalizer=normalizer)[0] for i in (0, 2, 4)]
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-6)
