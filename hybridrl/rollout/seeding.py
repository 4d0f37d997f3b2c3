"""Per-request seeds for engines that sample one request per (prompt, sample) with a seed of its own."""

from __future__ import annotations

import hashlib


def request_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a prompt seeded ``seed``: a hash of that pair alone, in [0, 2**63)
    (SGLang's ``sampling_seed`` is a signed 64-bit int; vLLM's ``SamplingParams.seed`` any int). Not a function of
    the prompt's position in a call, so a prompt samples the same wherever it sits."""
    digest = hashlib.blake2b(f"{seed},{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of training step ``step`` of a run seeded ``seed`` (``trainer.seed``): the loop's, and the
    asynchronous rollout's for a batch it draws ahead for that step."""
    return seed * 1_000_003 + step
