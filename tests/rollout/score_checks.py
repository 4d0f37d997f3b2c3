"""Shared by the engine tests: a teacher engine's ``score`` against the hf engine's on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridrl.interfaces import RolloutEngine

SEQS, STARTS = [[5, 6, 7, 8, 9, 20, 21, 22], [10, 11, 30, 31], [12, 13, 14, 40]], [5, 2, 3]


def scores_like_hf(engine: RolloutEngine, model: Path) -> None:
    """At T = 1, with top-k 0 and 4: each token's log-prob (1e-5), the top-k ids in order and their log-probs."""
    from hybridrl.rollout.engines.hf import HFRolloutEngine

    hf = HFRolloutEngine(HFRolloutEngine.Config(), model_path=str(model))
    for k in (0, 4):
        for got, want in zip(engine.score(SEQS, starts=STARTS, topk=k),  # type: ignore[attr-defined]
                             hf.score(SEQS, starts=STARTS, topk=k), strict=True):
            assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5)
            if k:
                assert torch.equal(got.topk_ids, want.topk_ids)
                assert torch.allclose(got.topk_logprobs, want.topk_logprobs, atol=1e-5)
            else:
                assert got.topk_ids is None
