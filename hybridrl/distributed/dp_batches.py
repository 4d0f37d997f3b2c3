"""Mini-batches that do not depend on the data-parallel size, and verl's ``trainer.balance_batch``.

Each DP rank generates, scores and computes the log-probs of its own contiguous share of a step's prompts. The
update's mini-batches are formed from the whole step, as one rank would form them: every rank learns every
sample's length (the shares in rank order are the step's sample order), each epoch's order is drawn from the update's
seed, and mini-batch k is samples [k·M, (k+1)·M) of that order (M = the mini-batch's samples over all DP ranks).
Each mini-batch is then split over the DP ranks, each getting M / DP samples:

- ``balance_batch=true``: so that the ranks' token counts (prompt + response tokens of their samples) are as even as
  equal sample counts allow — greedy longest-first: the samples by descending length, each to the rank with the
  fewest tokens so far among those not yet full (ties: the lower rank, the earlier sample);
- ``false``: in order, rank r the r-th contiguous slice.

Within a rank's share the samples keep their mini-batch order. Every rank computes the same split from the
lengths, then each sample travels once, from the rank that generated it to the rank that trains it (pairwise
sends: no rank ever holds the whole step). The loss is already normalised over the whole
mini-batch (``MegatronRunner._train_step``) and the gradients are summed over DP, so an update at DP = N is one
rank's update up to floating-point summation order: the same seed trains the same model when a run scales out.

Source: verl's ``balance_batch`` (``RayPPOTrainer._balance_batch``: the whole batch partitioned into DP parts of
equal size by attention-mask token counts, Karmarkar–Karp). Deviations: (1) the balance is within each
mini-batch — verl's reorders the whole batch, so there which samples form a mini-batch depends on the DP size;
(2) greedy longest-first under the equal-count constraint instead of Karmarkar–Karp (within one sample's length
of even on typical length spreads; simpler to reason about, and deterministic).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

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
    return (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).long().tolist()


@dataclass(frozen=True, slots=True)
class DPGroup:
    """This rank's place among the ranks that split each mini-batch (Megatron's data-parallel group)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None
    balance: bool = True

    def tokens(self, local: RolloutBatch) -> tuple[list[int], list[int]]:
        """Every sample's tokens over the whole step (the ranks' shares in rank order: the step's order), and where
        each rank's share starts in it."""
        mine = sample_tokens(local)
        if self.size == 1:
            return mine, [0]
        shares: list[list[int] | None] = [None] * self.size
        dist.all_gather_object(shares, mine, group=self.group)
        starts = [0]
        for share in shares[:-1]:
            starts.append(starts[-1] + len(share or []))
        return [t for share in shares for t in share or []], starts

    def parts(self, tokens: list[int]) -> list[list[int]]:
        """Every rank's share of a mini-batch whose samples have ``tokens``: indices into it."""
        if self.size == 1:
            return [list(range(len(tokens)))]
        return balanced_parts(tokens, self.size) if self.balance else in_order_parts(len(tokens), self.size)

    def fetch(self, local: RolloutBatch, starts: list[int],
              need: list[list[int]]) -> tuple[RolloutBatch, dict[int, int]]:
        """The samples at the whole step's positions ``need[self.rank]``, each sent by the rank that generated it
        (only what moves crosses the wire: every rank holds its own samples and the ones it trains), and where
        each position is in the batch returned."""
        if self.size == 1:
            return local, {g: g for g in need[0]}
        device, cpu = local.prompt_ids.device, local.to("cpu")
        mine = range(starts[self.rank], starts[self.rank] + len(local))

        def rows(positions: list[int]) -> tuple[list[int], RolloutBatch | None]:
            own = [g for g in positions if g in mine]
            return own, cpu.index([g - mine.start for g in own]) if own else None

        pieces = [rows(need[self.rank])]
        for d in range(1, self.size):
            to, frm = (self.rank + d) % self.size, (self.rank - d) % self.size
            pieces.append(self._swap(rows(need[to]), to=to, frm=frm))
        got = [(positions, b) for positions, b in pieces if b is not None]
        positions = [g for own, _ in got for g in own]
        held = RolloutBatch.cat([b for _, b in got])
        order = sorted(range(len(positions)), key=positions.__getitem__)
        return held.index(order).to(device), {positions[i]: k for k, i in enumerate(order)}

    def _swap(self, payload: object, *, to: int, frm: int) -> Any:
        """Send ``payload`` to group rank ``to`` while receiving one from ``frm`` (both at once: no deadlock)."""
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
            else torch.device("cpu")
        data = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8).to(device)
        peer_to, peer_frm = (dist.get_global_rank(self.group, r) if self.group is not None else r for r in (to, frm))
        size_in = torch.zeros(1, dtype=torch.long, device=device)
        for req in (dist.isend(torch.tensor([data.numel()], device=device), peer_to, group=self.group),
                    dist.irecv(size_in, peer_frm, group=self.group)):
            req.wait()
        buffer = torch.empty(int(size_in), dtype=torch.uint8, device=device)
        for req in (dist.isend(data, peer_to, group=self.group), dist.irecv(buffer, peer_frm, group=self.group)):
            req.wait()
        return pickle.loads(buffer.cpu().numpy().tobytes())

    def scatter_back(self, mine: torch.Tensor, positions: list[int], *, total: int, local: range,
                     width: int) -> torch.Tensor:
        """Rows of a per-sample ``[rows, T]`` result (``mine``: one row per position of this rank's share) put back
        on the ranks whose samples they are: the rows of ``local`` (this rank's samples in the whole step), ``width``
        columns (zero-padded or cut)."""
        if self.size == 1:
            out = torch.zeros((total, max(width, mine.shape[1]), *mine.shape[2:]), dtype=mine.dtype,
                              device=mine.device)
            out[positions, :mine.shape[1]] = mine
            return out[local.start:local.stop, :width]
        pieces: list[tuple[list[int], torch.Tensor] | None] = [None] * self.size
        dist.all_gather_object(pieces, (positions, mine.cpu()), group=self.group)
        widest = max([width, *(p[1].shape[1] for p in pieces if p is not None)])
        out = torch.zeros((total, widest, *mine.shape[2:]), dtype=mine.dtype)
        for piece in pieces:
            assert piece is not None
            rows, values = piece
            out[rows, :values.shape[1]] = values
        return out[local.start:local.stop, :width].to(mine.device)


def imbalance(tokens: list[int], parts: list[list[int]]) -> float:
    """The busiest rank's tokens over the mean rank's, for one mini-batch of samples with ``tokens`` (1.0: even)."""
    sums = [sum(tokens[i] for i in p) for p in parts]
    return max(sums) / max(sum(sums) / len(sums), 1e-9)


def epochs(local: RolloutBatch, step: Callable[[RolloutBatch], dict[str, float]], *, dp: DPGroup, epochs: int,
           mini_batch: int, order: Callable[[int, torch.Generator], torch.Tensor],
           seed: int) -> list[dict[str, float]]:
    """``step`` on this rank's share of each mini-batch, ``epochs`` times over the whole step's samples in the
    order ``order(n, generator)`` draws anew each epoch; one metrics dict per optimizer step (with
    ``dp_token_imbalance`` when DP > 1). ``mini_batch``: one rank's samples per mini-batch."""
    tokens, starts = dp.tokens(local)
    gen = torch.Generator().manual_seed(seed)
    plan = []  # every optimizer step's mini-batch (positions in the whole step) and its split over the ranks
    for _ in range(epochs):
        for positions in _mini_batches(order(len(tokens), gen), mini_batch * dp.size):
            at = positions.tolist()
            plan.append((at, dp.parts([tokens[g] for g in at])))
    held, where = dp.fetch(local, starts, [sorted({at[i] for at, parts in plan for i in parts[r]})
                                           for r in range(dp.size)])
    steps = []
    for at, parts in plan:
        index = torch.tensor([where[at[i]] for i in parts[dp.rank]], dtype=torch.long, device=held.prompt_ids.device)
        metrics = step(held.index(index))
        if dp.size > 1:
            metrics["dp_token_imbalance"] = imbalance([tokens[g] for g in at], parts)
        steps.append(metrics)
    return steps


def _mini_batches(order: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    yield from order.split(size)
