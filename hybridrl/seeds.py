"""Every seed a run derives from ``trainer.seed``, in one place.

A run's randomness is a function of ``trainer.seed`` and where it is used, never of the parallel layout or of
which rank or engine does the work:

- :func:`step_seed`: the sampling seed of training step k (the asynchronous rollout's for a batch it draws ahead
  for that step too); round r of DAPO's dynamic sampling adds r·:data:`ROUND_SEED_STRIDE`;
- :func:`prompt_seed`: a prompt's seed from its batch's seed and its position in the batch (each engine seeds its
  share with these, so a sample does not depend on how the batch is split); turns and continued samples chain it;
- :func:`request_seed`: one sample of a prompt, for engines that take one request per sample;
- :func:`update_seed`: the shuffling of step k's mini-batches (actor and critic);
- :func:`eval_seed`: batch j of an evaluation (apart from every training step's seed).
"""

from __future__ import annotations

import hashlib

ROUND_SEED_STRIDE = 2**32  # round r samples with seed + r·stride (steps differ by 1 in the seed)


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of training step ``step`` of a run seeded ``seed``."""
    return seed * 1_000_003 + step


def eval_seed(seed: int, batch: int) -> int:
    """The sampling seed of evaluation batch ``batch`` (0, 1, …): below every step's seed of the run."""
    return seed * 1_000_003 - batch - 1


def update_seed(seed: int, step: int) -> int:
    """The seed of step ``step``'s mini-batch order (``actor.shuffle``, ``critic.shuffle``)."""
    return seed * 7919 + step


def prompt_seed(seed: int, position: int) -> int:
    """The seed of the prompt at ``position`` of a batch sampled with ``seed`` (63-bit, well mixed: splitmix64)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) % 2**64
    x = ((x ^ (x >> 31)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 29)) >> 1


def request_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a prompt seeded ``seed``: a hash of that pair alone, in [0, 2**63)
    (SGLang's ``sampling_seed`` is a signed 64-bit int; vLLM's ``SamplingParams.seed`` any int). Not a function of
    the prompt's position in a call, so a prompt samples the same wherever it sits."""
    digest = hashlib.blake2b(f"{seed},{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
