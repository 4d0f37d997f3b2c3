"""The algorithm contracts: check_advantage_estimator and check_policy_loss."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridrl.algorithms.loss_agg import LOSS_AGG_MODES, local_normalizer
from hybridrl.interfaces import AdvantageEstimator, PolicyLoss
from hybridrl.testing.kit import _Plugin, _tensors_equal, check_plugin_class

# ---- advantage estimators -----------------------------------------------------------------------------


def check_advantage_estimator(cls: type, *, config: Any = None, seed: int = 0) -> None:
    """Check an advantage estimator on a random ragged batch of 4 prompts × 2 samples."""
    p = _Plugin(cls, "advantage_estimators")
    config = check_plugin_class(cls, "advantage_estimators", config=config)
    with p.step("built as cls(config)"):
        est = cls(config)
    p.expect(isinstance(est, AdvantageEstimator), "AdvantageEstimator protocol",
             "the instance is not callable or lacks Config/needs_group/needs_critic")
    g = torch.Generator().manual_seed(seed)
    mask_BT = _mask_BT([6, 2, 5, 1, 3, 6, 4, 4], 6)
    inputs: dict[str, torch.Tensor | None] = dict(
        token_rewards_BT=torch.randn(mask_BT.shape, generator=g) * mask_BT, response_mask_BT=mask_BT,
        group_index_B=torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]),
        values_BT=torch.randn(mask_BT.shape, generator=g) * mask_BT if cls.needs_critic else None,  # type: ignore[attr-defined]
    )
    if getattr(cls, "needs_teacher", False):  # a distillation estimator: log-probs of the student and the teacher
        inputs["logprobs_BT"] = -torch.rand(mask_BT.shape, generator=g) * 3 * mask_BT
        inputs["teacher_logprobs_BT"] = -torch.rand(mask_BT.shape, generator=g) * 3 * mask_BT
    before = {k: v.clone() for k, v in inputs.items() if v is not None}
    out = _estimate(p, est, inputs, "__call__ on a ragged batch")
    for name, x in zip(("advantages_BT", "returns_BT"), out, strict=True):
        p.expect(tuple(x.shape) == tuple(mask_BT.shape) and x.dtype == mask_BT.dtype, f"{name} is [B, T] float",
                 f"{tuple(x.shape)} {x.dtype}, expected {tuple(mask_BT.shape)} {mask_BT.dtype}")
        p.expect(bool(torch.isfinite(x).all()), f"{name} is finite", f"{name} = {x.tolist()}")
        p.expect(bool((x[mask_BT == 0] == 0).all()), f"{name} is zero outside the response mask",
                 f"{name} = {x.tolist()}, mask = {mask_BT.tolist()}")
    p.expect(bool(out[0].abs().sum() > 0), "advantages are not all zero",
             "all advantages are 0 on a batch whose samples have different rewards")
    p.expect(_tensors_equal(before, inputs), "leaves its inputs unchanged",
             "an input tensor changed during the call")
    _expect_same(p, "the same inputs twice give the same outputs", out,
                 _estimate(p, est, inputs, "__call__ a second time"), exact=True)
    perm = torch.randperm(len(mask_BT), generator=g)
    row_ids = torch.tensor([907, 13, 4000, 2])  # dataset row ids, as the trainer passes them
    shuffled = {k: None if v is None else v[perm] for k, v in inputs.items()}
    shuffled["group_index_B"] = row_ids[inputs["group_index_B"]][perm]  # type: ignore[index]
    _expect_same(p, "outputs follow the samples when they are shuffled and the group ids are dataset rows",
                 tuple(x[perm] for x in out), _estimate(p, est, shuffled, "__call__ on the shuffled batch"))


def _estimate(p: _Plugin, est: Any, inputs: Mapping[str, torch.Tensor | None],
              check: str) -> tuple[torch.Tensor, torch.Tensor]:
    with p.step(check):
        out = est(**inputs)
    p.expect(isinstance(out, tuple) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out),
             "returns (advantages_BT, returns_BT)", f"returned {type(out).__name__}")
    return out[0], out[1]


# ---- policy losses ------------------------------------------------------------------------------------


def check_policy_loss(cls: type, *, config: Any = None, loss_agg_modes: Sequence[str] = LOSS_AGG_MODES,
                      seed: int = 0) -> None:
    """Check a policy loss in each of ``loss_agg_modes`` on a random ragged batch."""
    p = _Plugin(cls, "policy_losses")
    config = check_plugin_class(cls, "policy_losses", config=config)
    with p.step("built as cls(config)"):
        loss_fn = cls(config)
    p.expect(isinstance(loss_fn, PolicyLoss), "PolicyLoss protocol", "the instance is not callable or has no Config")
    g = torch.Generator().manual_seed(seed)
    mask_BT = _mask_BT([5, 1, 4, 0, 3], 5)  # an empty response too
    old_BT = -torch.rand(mask_BT.shape, generator=g) * 3
    noisy_BT = old_BT + torch.randn(mask_BT.shape, generator=g) * 0.3  # some tokens outside the clip range
    adv_BT = torch.randn(mask_BT.shape, generator=g) * mask_BT
    for mode in loss_agg_modes:
        inputs = dict(old_logprobs_BT=old_BT, advantages_BT=adv_BT, response_mask_BT=mask_BT, loss_agg_mode=mode)
        before = {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        logp_BT = noisy_BT.clone().requires_grad_(True)
        loss, metrics = _loss(p, loss_fn, dict(inputs, logprobs_BT=logp_BT), f"__call__ ({mode})")
        p.expect(loss.dim() == 0 and bool(torch.isfinite(loss)) and loss.requires_grad,
                 f"a finite scalar loss with a gradient ({mode})",
                 f"loss {loss!r} (dim {loss.dim()}, requires_grad {loss.requires_grad})")
        missing = {"pg_loss", "clipfrac", "ppo_kl"} - set(metrics)
        p.expect(not missing, f"metrics include pg_loss, clipfrac, ppo_kl ({mode})", f"missing {sorted(missing)}")
        for name, value in metrics.items():
            p.expect(isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad
                     and bool(torch.isfinite(value)), f"metric {name!r} is a finite 0-dim tensor without grad ({mode})",
                     f"got {value!r}")
        with p.step(f"loss.backward() ({mode})"):
            loss.backward()
        grad = logp_BT.grad
        p.expect(grad is not None and bool(torch.isfinite(grad).all()), f"the gradient is finite ({mode})",
                 f"grad = {grad}")
        assert grad is not None
        p.expect(bool((grad[mask_BT == 0] == 0).all()), f"no gradient on padding ({mode})", f"grad = {grad.tolist()}")
        p.expect(_tensors_equal(before, inputs), f"leaves its inputs unchanged ({mode})",
                 "an input tensor changed during the call")
        again = _loss(p, loss_fn, dict(inputs, logprobs_BT=noisy_BT.clone()), f"__call__ again ({mode})")
        _expect_same(p, f"the same inputs twice give the same loss and metrics ({mode})",
                     (loss.detach(), *[metrics[k] for k in sorted(metrics)]),
                     (again[0].detach(), *[again[1].get(k, torch.tensor(math.nan)) for k in sorted(metrics)]),
                     exact=True)
        _, on_policy = _loss(p, loss_fn, dict(inputs, logprobs_BT=old_BT.clone()), f"__call__ on-policy ({mode})")
        p.expect(abs(on_policy["ppo_kl"].item()) < 1e-7 and on_policy["clipfrac"].item() == 0,
                 f"on-policy (logprobs == old): ppo_kl == 0 and clipfrac == 0 ({mode})",
                 f"ppo_kl {on_policy['ppo_kl'].item()}, clipfrac {on_policy['clipfrac'].item()}")
        norm = local_normalizer(mask_BT, mode)
        whole = _loss(p, loss_fn, dict(inputs, logprobs_BT=noisy_BT, global_normalizer=norm),
                      f"__call__ with global_normalizer ({mode})")[0]
        parts = [_loss(p, loss_fn, dict(old_logprobs_BT=old_BT[rows], advantages_BT=adv_BT[rows],
                                         response_mask_BT=mask_BT[rows], loss_agg_mode=mode,
                                         logprobs_BT=noisy_BT[rows], global_normalizer=norm),
                       f"__call__ on a micro-batch ({mode})")[0] for rows in (slice(0, 2), slice(2, None))]
        _expect_same(p, f"global_normalizer = the batch's own denominator gives the plain loss ({mode})",
                     (loss.detach(),), (whole.detach(),))
        _expect_same(p, f"micro-batch losses with the mini-batch's global_normalizer add up to its loss ({mode})",
                     (whole.detach(),), (torch.stack(parts).detach().sum(),))


def _loss(p: _Plugin, loss_fn: Any, inputs: Mapping[str, Any], check: str) -> tuple[torch.Tensor, dict[str, Any]]:
    with p.step(check):
        out = loss_fn(**inputs)
    p.expect(isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)
             and isinstance(out[1], Mapping), "returns (loss, metrics)", f"returned {type(out).__name__}")
    return out[0], dict(out[1])


def _mask_BT(lengths: list[int], t: int) -> torch.Tensor:
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()


def _expect_same(p: _Plugin, check: str, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], *,
                 exact: bool = False) -> None:
    same = len(a) == len(b) and all(
        x.shape == y.shape and (torch.equal(x, y) if exact else torch.allclose(x, y, rtol=1e-5, atol=1e-6))
        for x, y in zip(a, b, strict=True))
    p.expect(same, check, lambda: f"{[x.tolist() for x in a]} vs {[y.tolist() for y in b]}")
