"""The reward manager contract: check_reward_manager."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hybridrl.batch import RolloutBatch
from hybridrl.interfaces import RewardManager, RewardOutput
from hybridrl.testing.batches import make_batch
from hybridrl.testing.kit import _Plugin, _tensors, _tensors_equal, check_plugin_class

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def check_reward_manager(cls: type, *, config: Any = None, tokenizer: PreTrainedTokenizerBase,
                         batch: RolloutBatch | None = None, picklable: bool = True, **ctx: Any) -> RewardOutput:
    """Check a reward manager on ``batch`` (default :func:`make_batch`); return its output.

    ``ctx``: context keys besides ``tokenizer`` that the trainer passes. ``picklable=False`` skips
    the pickling check (only for a reward that never runs in worker processes)."""
    p = _Plugin(cls, "reward_managers")
    config = check_plugin_class(cls, "reward_managers", config=config)
    batch = batch if batch is not None else make_batch(tokenizer)
    ctx_keys = ", ".join(["tokenizer", *ctx])
    with p.step(f"built as cls(config, {ctx_keys}=...)"):
        reward = cls(config, tokenizer=tokenizer, **ctx)
    p.expect(isinstance(reward, RewardManager), "RewardManager protocol",
             "the instance is not callable or has no Config (hybridrl.interfaces.RewardManager)")
    before = _tensors(batch)
    with p.step("__call__(batch)"):
        out = reward(batch)
    _check_reward_output(p, out, batch)
    p.expect(_tensors_equal(before, _tensors(batch)), "leaves the batch unchanged",
             "a tensor of the batch changed during the call; the trainer reads the batch afterwards")
    with p.step("__call__(batch) a second time"):
        again = reward(batch)
    _expect_same_reward(p, "the same batch twice scores the same", out, again)
    if picklable:
        with p.step("class and config round-trip through pickle (reward worker processes)"):
            cls2, config2 = pickle.loads(pickle.dumps((cls, config)))
        p.expect(cls2 is cls and dataclasses.asdict(config2) == dataclasses.asdict(config),
                 "class and config round-trip through pickle",
                 f"unpickled {cls2!r} with {config2!r}, expected {cls!r} with {config!r}")
        with p.step("the plugin rebuilt from the unpickled config scores"):
            rebuilt = cls2(config2, tokenizer=tokenizer, **ctx)(batch)
        _expect_same_reward(p, "the plugin rebuilt from the unpickled config scores the same", out, rebuilt)
    return out


def _check_reward_output(p: _Plugin, out: Any, batch: RolloutBatch) -> None:
    b, device = len(batch), batch.response_ids.device
    p.expect(isinstance(out, RewardOutput), "returns a RewardOutput", f"returned a {type(out).__name__}")
    s = out.scores_B
    p.expect(isinstance(s, torch.Tensor) and s.dtype.is_floating_point and tuple(s.shape) == (b,),
             "scores_B is a float tensor [B]",
             lambda: f"got {type(s).__name__} {getattr(s, 'dtype', '')} {tuple(getattr(s, 'shape', ()))}, B={b}")
    p.expect(bool(torch.isfinite(s).all()), "scores_B is finite", f"scores_B = {s.tolist()}")
    p.expect(s.device == device, "scores_B is on the batch's device", f"{s.device}, the batch is on {device}")
    p.expect(not s.requires_grad, "scores_B carries no autograd graph", "scores_B.requires_grad is True")
    c = out.correct_B
    p.expect(c is None or isinstance(c, torch.Tensor) and c.dtype == torch.bool and tuple(c.shape) == (b,)
             and c.device == device, "correct_B is None or a bool tensor [B] on the batch's device",
             lambda: f"got {type(c).__name__} {getattr(c, 'dtype', '')} {tuple(getattr(c, 'shape', ()))} "
                     f"on {getattr(c, 'device', '-')}, B={b}")
    p.expect(isinstance(out.info, Mapping), "info is a dict of per-sample lists", f"info is a {type(out.info)}")
    bad = {k: v for k, v in out.info.items() if not isinstance(k, str) or not isinstance(v, list) or len(v) != b}
    p.expect(not bad, "info is a dict of per-sample lists",
             lambda: f"entries {sorted(map(str, bad))} are not lists of B={b} values: "
                     f"{ {k: type(v).__name__ for k, v in bad.items()} }")


def _expect_same_reward(p: _Plugin, check: str, a: RewardOutput, b: Any) -> None:
    p.expect(isinstance(b, RewardOutput), check, f"returned a {type(b).__name__}")
    same = (torch.equal(a.scores_B, b.scores_B)
            and (a.correct_B is None) == (b.correct_B is None)
            and (a.correct_B is None or torch.equal(a.correct_B, b.correct_B))
            and a.info == b.info)
    p.expect(same, check, lambda: f"scores {a.scores_B.tolist()} then {b.scores_B.tolist()}; correct "
             f"{_listed(a.correct_B)} then {_listed(b.correct_B)}; info {a.info} then {b.info}")


def _listed(x: torch.Tensor | None) -> Any:
    return None if x is None else x.tolist()
