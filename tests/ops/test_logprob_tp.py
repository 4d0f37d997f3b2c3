"""Fused log-prob/entropy (hybridrl.ops, C++ and plain-PyTorch kernels, logits and LM-head forms, through
``vocab_parallel_logprob_entropy(fused=True)`` too) vs exact fp64 values and the current implementation, at
TP=1 and TP=2, with vocab padding (a TP rank holding only padding included), temperature, and bf16 logits."""

from pathlib import Path

import pytest

WORKER = str(Path(__file__).parent / "workers" / "logprob_tp.py")


@pytest.mark.distributed
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_logprob_entropy_matches_current_and_exact(torchrun, tp: int) -> None:
    out = torchrun([WORKER, str(tp)], nproc=tp)
    assert "fused vs exact" in out.stdout and out.stdout.rstrip().endswith("OK"), out.stdout
