"""Mini-batches that do not depend on the data-parallel size, and verl's ``trainer.balance_batch``.

Each DP rank generates, scores and computes the log-probs of its own contiguous share of a step's prompts. The
update's mini-batches are formed from the whole step, as one rank would form them: the shares are gathered over
the DP group (in rank order, which is the step's sample order), each epoch's order is drawn from the update's seed,
and mini-batch k is samples [k·M, (k+1)·M) of that order (M = the mini-batch's samples over all DP ranks). Each
mini-batch is then split over the DP ranks, each getting M / DP samples:

- ``balance_batch=true``: so that the ranks' token counts (prompt + response tokens of their samples) are as even as
  equal sample counts allow — greedy longest-first: the samples by descending length, each to the rank with the
  fewest tokens so far among those not yet full (ties: the lower rank, the earlier sample);
- ``false``: in order, rank r the r-th contiguous slice.

Within a rank's share the samples keep their mini-batch order. The loss is already normalised over the whole
mini-batch (``MegatronRunner._train_step``) and the gradients are summed over DP, so an update at DP = N is one
rank's update up to floating-point summation order: the same seed trains the same model when a run scales out.

Source: verl's ``balance_batch`` (``RayPPOTrainer._balance_batch``: the whole batch partitioned into DP parts of
equal size by attention-mask token counts, Karmarkar–Karp). Deviations: (1) the balance is within each
mini-batch — verl's reorders the whole batch, so there which samples form a mini-batch depends on the DP size;
(2) greedy longest-first under the equal-count constraint instead of Karmarkar–Karp (within one sample's length
of even on typical length spreads; simpler to reason about, and deterministic).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.batch import RolloutBatch


def balanced_parts(tokens: list[int], parts: int) -> list[list[int]]:
    """Indices of ``tokens`` in ``parts`` parts of equal size with token sums as even as the greedy gets them; each
    part in ascending index order. ``len(tokens)`` must be a multiple of ``parts``."""
    if len(tokens) % parts:
        raise ValueError(f"{len(tokens)} samples do not split into {parts} equal parts")
    size = len(tokens) // parts
    out: list[list[int]] = [[] for _ in range(parts)]
    sums = [0] * parts
    for i in sorted(range(len(tokens)), key=lambda k: (-tokens[k], k)):
        r = min((r for r in range(parts) if len(out[r]) < size), key=lambda r: (sums[r], r))
        out[r].append(i)
        sums[r] += tokens[i]
    return [sorted(p) for p in out]


def in_order_parts(n: int, parts: int) -> list[list[int]]:
    """``n`` indices in ``parts`` contiguous parts of equal size."""
    if n % parts:
        raise ValueError(f"{n} samples do not split into {parts} equal parts")
    size = n // parts
    return [list(range(r * size, (r + 1) * size)) for r in range(parts)]


def sample_tokens(batch: RolloutBatch) -> list[int]:
    """Each sample's prompt + response tokens: what a rank's forward and backward cost (verl's attention-mask sum)."""
    return (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()


@dataclass(frozen=True, slots=True)
class DPGroup:
    """This rank's place among the ranks that split each mini-batch (Megatron's data-parallel group)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    balance: bool = True

    def gather(self, local: RolloutBatch) -> RolloutBatch:
        """The whole step: every DP rank's share, in rank order (this rank's own when DP = 1)."""
        if self.size == 1:
            return local
        shares: list[RolloutBatch | None] = [None] * self.size
        dist.all_gather_object(shares, local.to("cpu"), group=self.group)
        return RolloutBatch.cat([s for s in shares if s is not None]).to(local.prompt_ids.device)

    def parts(self, whole: RolloutBatch, positions: torch.Tensor) -> list[list[int]]:
        """Every rank's share of the mini-batch made of ``whole``'s samples at ``positions``: indices into
        ``positions``."""
        if self.size == 1:
            return [list(range(len(positions)))]
        if not self.balance:
            return in_order_parts(len(positions), self.size)
        return balanced_parts(sample_tokens(whole.index(positions)), self.size)

    def scatter_back(self, mine: torch.Tensor, positions: list[int], *, total: int, local: range) -> torch.Tensor:
        """Rows of a per-sample result (``mine``: one row per position of this rank's share) put back on the
        ranks whose samples they are: the rows of ``local`` (this rank's samples in the whole step)."""
        if self.size == 1:
            out = torch.empty((total, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
            out[positions] = mine
            return out[local.start:local.stop]
        pieces: list[tuple[list[int], torch.Tensor] | None] = [None] * self.size
        dist.all_gather_object(pieces, (positions, mine.cpu()), group=self.group)
        width = max(p[1].shape[1] for p in pieces if p is not None)
        out = torch.zeros((total, width, *mine.shape[2:]), dtype=mine.dtype)
        for piece in pieces:
            assert piece is not None
            rows, values = piece
            out[rows, :values.shape[1]] = values
        return out[local.start:local.stop].to(mine.device)

    def local_range(self, local: RolloutBatch) -> range:
        """Where this rank's samples sit in the whole step."""
        if self.size == 1:
            return range(len(local))
        counts: list[int | None] = [None] * self.size
        dist.all_gather_object(counts, len(local), group=self.group)
        start = sum(c or 0 for c in counts[:self.rank])
        return range(start, start + len(local))


def imbalance(whole: RolloutBatch, positions: torch.Tensor, parts: list[list[int]]) -> float:
    """The busiest rank's tokens over the mean rank's, for one mini-batch (1.0: even)."""
    tokens = sample_tokens(whole.index(positions))
    sums = [sum(tokens[i] for i in p) for p in parts]
    return max(sums) / max(sum(sums) / len(sums), 1e-9)


def epochs(local: RolloutBatch, step: Callable[[RolloutBatch], dict[str, float]], *, dp: DPGroup, epochs: int,
           mini_batch: int, order: Callable[[int, torch.Generator], torch.Tensor],
           seed: int) -> list[dict[str, float]]:
    """``step`` on this rank's share of each mini-batch, ``epochs`` times over the whole step's samples in the
    order ``order(n, generator)`` draws anew each epoch; one metrics dict per optimizer step (with
    ``dp_token_imbalance`` when DP > 1). ``mini_batch``: one rank's samples per mini-batch."""
    whole = dp.gather(local)
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(epochs):
        for positions in _mini_batches(order(len(whole), gen), mini_batch * dp.size):
            parts = dp.parts(whole, positions)
            metrics = step(whole.index(positions[parts[dp.rank]].to(whole.prompt_ids.device)))
            if dp.size > 1:
                metrics["dp_token_imbalance"] = imbalance(whole, positions, parts)
            steps.append(metrics)
    return steps


def _mini_batches(order: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    yield from order.split(size)
