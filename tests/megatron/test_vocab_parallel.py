"""Vocab-parallel log-prob and entropy, and the top-k distillation loss's top-k log-probs and log-probs at given ids:
exact values and gradients at TP=1 and TP=2 (a k larger than one shard), padding masked and never chosen."""

from pathlib import Path

import pytest

WORKER = str(Path(__file__).parent / "workers" / "vocab_parallel.py")


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_logprob_entropy_matches_full_vocab(torchrun, tp: int) -> None:
    out = torchrun([WORKER, str(tp)], nproc=tp)
    assert "OK" in out.stdout
