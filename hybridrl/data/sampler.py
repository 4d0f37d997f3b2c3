"""A seeded, resumable sampler that gives each data-parallel rank its shard of every global batch.

Every rank computes the same permutation of the dataset for an epoch, from ``(seed, epoch)`` alone,
cuts it into global batches of ``train_batch_size`` prompts and takes its contiguous slice of
``train_batch_size / dp_size`` indices from each, so the ranks' shards are disjoint and together
are the global batch. ``shuffle=False`` keeps dataset order.

``drop_last`` (per epoch):
- ``True``: the last ``len(dataset) % train_batch_size`` prompts of each epoch's order are skipped;
  which ones changes every epoch when shuffling.
- ``False``: the last global batch is filled up with the epoch's first indices (wrapping around),
  so every batch is full and every rank gets the same number of prompts (a collective-safe SPMD
  step); those few prompts are seen twice in that epoch.

The position is counted in global batches, so a state saved at one DP size resumes at another.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from hybridrl.config.errors import DataError


@dataclass(slots=True, kw_only=True)
class SamplerConfig:
    train_batch_size: int  # prompts per global batch, over all DP ranks
    shuffle: bool = True
    seed: int = 1
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.train_batch_size < 1:
            raise ValueError(f"data.train_batch_size={self.train_batch_size} must be >= 1")


class DistributedPromptSampler:
    """Yields this rank's dataset indices for each global batch; one epoch per ``iter()``.

    ``state_dict()`` always names the next global batch to produce (taken as consumed once
    yielded), so saving after a step and loading into a new sampler continues exactly there.
    """

    def __init__(self, num_samples: int, *, config: SamplerConfig, dp_rank: int, dp_size: int) -> None:
        if config.train_batch_size % dp_size:
            raise ValueError(f"data.train_batch_size={config.train_batch_size} must be divisible by the "
                             f"data-parallel size {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, {dp_size})")
        if config.drop_last and num_samples < config.train_batch_size:
            raise DataError(f"the dataset has {num_samples} prompts, fewer than one global batch "
                             f"(data.train_batch_size={config.train_batch_size}) with drop_last")
        if num_samples < 1:
            raise ValueError("the dataset is empty")
        self.num_samples = num_samples
        self.config = config
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.epoch = 0
        self.batch_in_epoch = 0  # next global batch of ``epoch`` to produce

    def __len__(self) -> int:
        """Global batches per epoch."""
        b = self.config.train_batch_size
        return self.num_samples // b if self.config.drop_last else -(-self.num_samples // b)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All indices of one epoch, in order, cut to (drop_last) or filled to whole global batches."""
        n, b = self.num_samples, self.config.train_batch_size
        if self.config.shuffle:
            order = np.random.default_rng([self.config.seed, epoch]).permutation(n)
        else:
            order = np.arange(n)
        length = len(self) * b
        return order[:length] if length <= n else np.resize(order, length)  # resize wraps around

    def __iter__(self) -> Iterator[list[int]]:
        epoch, order = self.epoch, self.epoch_order(self.epoch)
        b = self.config.train_batch_size
        per_rank = b // self.dp_size
        for k in range(self.batch_in_epoch, len(self)):
            start = k * b + self.dp_rank * per_rank
            self.epoch, self.batch_in_epoch = (epoch, k + 1) if k + 1 < len(self) else (epoch + 1, 0)
            yield order[start : start + per_rank].tolist()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.config.seed,
            "num_samples": self.num_samples,
            "train_batch_size": self.config.train_batch_size,
            "shuffle": int(self.config.shuffle),
            "drop_last": int(self.config.drop_last),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, now in (("seed", self.config.seed), ("num_samples", self.num_samples),
                         ("train_batch_size", self.config.train_batch_size),
                         ("shuffle", int(self.config.shuffle)), ("drop_last", int(self.config.drop_last))):
            if state[key] != now:
                raise ValueError(f"cannot resume the sampler: saved {key}={state[key]}, now {now}; "
                                 f"the data order would differ")
        if not 0 <= state["batch_in_epoch"] < len(self):
            raise ValueError(f"saved batch_in_epoch={state['batch_in_epoch']} is outside [0, {len(self)})")
        self.epoch = state["epoch"]
        self.batch_in_epoch = state["batch_in_epoch"]
