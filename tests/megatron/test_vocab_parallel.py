"""Vocab-parallel log-prob and entropy: exact values and gradients at TP=1 and TP=2, padding masked."""

from pathlib import Path

import pytest

WORKER = str(Path(__file__).parent / "workers" / "vocab_parallel.py")


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_logprob_entropy_matches_full_vocab(torchrun, tp: int) -> None:
    out = torchrun([WORKER, str(tp)], nproc=tp)
    assert "OK" in out.stdout
