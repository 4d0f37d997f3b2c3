"""The update's mini-batches at any DP size (``hybridrl/distributed/dp_batches.py``): one rank's mini-batches, each
split over the DP ranks — evenly by tokens with ``trainer.balance_batch`` — and per-sample results sent back to the
rank whose sample it is. The whole runs at DP = 2 are in ``tests/parallel/test_train_layouts.py`` and
``tests/trainers/test_train_moe.py``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from hybridrl.batch import RolloutBatch, SampleMeta
from hybridrl.distributed.dp_batches import DPGroup, balanced_parts, epochs, in_order_parts


def batch(lengths: list[int], *, prompt: int = 3, first: int = 0) -> RolloutBatch:
    """Samples with these response lengths (prompts of ``prompt`` tokens), ids numbering them from ``first``."""
    B, T = len(lengths), max(lengths)
    response_mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    ids = torch.arange(first, first + B)[:, None]
    return RolloutBatch(prompt_ids=ids.repeat(1, prompt), prompt_mask=torch.ones(B, prompt),
                        response_ids=ids.repeat(1, T), response_mask=response_mask,
                        rollout_logprobs=torch.zeros(B, T), weight_version=torch.zeros(B, dtype=torch.long),
                        group_index=torch.arange(B) // 2, meta=[SampleMeta() for _ in range(B)], pad_token_id=0)


def test_balanced_parts_are_equal_in_size_and_even_in_tokens() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 50, 60, 70, 80]  # the long ones last: in order, the last rank gets them all
    parts = balanced_parts(tokens, 3)
    assert sorted(i for p in parts for i in p) == list(range(12)) and {len(p) for p in parts} == {4}
    assert all(p == sorted(p) for p in parts)  # each rank keeps the mini-batch's order
    sums = [sum(tokens[i] for i in p) for p in parts]
    ordered = [sum(tokens[i] for i in p) for p in in_order_parts(12, 3)]
    assert max(sums) - min(sums) <= max(tokens) and max(sums) / (sum(sums) / 3) < 1.15
    assert max(ordered) / (sum(ordered) / 3) > 2.5  # 266 of 296 tokens on the last rank
    with pytest.raises(ValueError, match="do not split into 3 equal parts"):
        balanced_parts(tokens[:10], 3)


def test_at_dp1_the_mini_batches_are_the_step_in_order_or_shuffled() -> None:
    whole = batch([2, 4, 6, 8, 1, 3, 5, 7])
    seen: list[list[int]] = []

    def step(mini: RolloutBatch) -> dict[str, float]:
        seen.append(mini.prompt_ids[:, 0].tolist())
        return {"n": float(len(mini))}

    def shuffled(n: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randperm(n, generator=gen)

    assert epochs(whole, step, dp=DPGroup(rank=0, size=1), epochs=2, mini_batch=4, order=shuffled, seed=3) == [
        {"n": 4.0}] * 4
    gen = torch.Generator().manual_seed(3)
    want = [torch.randperm(8, generator=gen).tolist() for _ in range(2)]
    assert seen == [want[0][:4], want[0][4:], want[1][:4], want[1][4:]]


WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[2])
    from test_dp_batches import batch
    from hybridrl.distributed.dp_batches import DPGroup, epochs
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lengths = [1, 2, 3, 4, 9, 10, 11, 12]  # rank 0 generated the short ones, rank 1 the long ones
    local = batch(lengths[4 * rank:4 * rank + 4], first=4 * rank)
    out = {}
    for balance in (True, False):
        dp = DPGroup(rank=rank, size=2, balance=balance)
        seen = []
        steps = epochs(local, lambda m: seen.append(m.prompt_ids[:, 0].tolist()) or {"loss": 0.0}, dp=dp, epochs=1,
                       mini_batch=2, order=lambda n, g: torch.arange(n), seed=0)
        out[str(balance)] = {"seen": seen, "imbalance": [s["dp_token_imbalance"] for s in steps]}
    dp = DPGroup(rank=rank, size=2)
    tokens, starts = dp.tokens(local)
    out["tokens"], out["starts"] = tokens, starts
    held, where = dp.fetch(local, starts, [[1, 6], [0, 2, 5]])  # rank 0 wants 1 (its own) and 6; rank 1 0, 2, 5
    out["held"] = held.prompt_ids[:, 0].tolist()
    out["where"] = {str(k): v for k, v in where.items()}
    positions = [7 - rank, 3 - rank]  # this rank computed rows for the whole step's samples 7, 3 (or 6, 2)
    mine = torch.tensor([[10.0 * p, p] for p in positions])
    back = dp.scatter_back(mine, positions, total=8, local=range(starts[rank], starts[rank] + 4), width=3)
    out["back"] = back.tolist()
    with open(f"{sys.argv[1]}/{rank}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
""")


def test_two_ranks_split_each_mini_batch_and_get_their_rows_back(torchrun, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """2 gloo ranks: every sample's length is known everywhere, in rank order; each mini-batch of 4 (2 a rank) is
    split by tokens (balance) or in order; a rank holds only the samples it asked for, sent by their owners; rows
    computed for any sample come back to the rank that generated it. ~10 s."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun([str(script), str(tmp_path), str(Path(__file__).parent)], nproc=2, timeout=120)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    # mini-batches: samples 0-3 (all of rank 0's), then 4-7 (rank 1's); in order, rank 0 takes each one's first half
    assert r0["False"]["seen"] == [[0, 1], [4, 5]] and r1["False"]["seen"] == [[2, 3], [6, 7]]
    # balanced, longest first: tokens 7 → rank 0, 6 → 1, 5 → 1, 4 → 0: 11 each
    for k in range(2):
        assert sorted(r0["True"]["seen"][k] + r1["True"]["seen"][k]) == list(range(4 * k, 4 * k + 4))
    assert r0["True"]["seen"] == [[0, 3], [4, 7]] and r1["True"]["seen"] == [[1, 2], [5, 6]]
    assert r0["True"]["imbalance"] == [1.0, 1.0] and min(r0["False"]["imbalance"]) > 1.0
    assert r0["tokens"] == r1["tokens"] == [4, 5, 6, 7, 12, 13, 14, 15] and r0["starts"] == [0, 4]
    # each rank holds what it asked for, in the step's order, and nothing else: 6 came from rank 1, 0 and 2 from rank 0
    assert r0["held"] == [1, 6] and r0["where"] == {"1": 0, "6": 1}
    assert r1["held"] == [0, 2, 5] and r1["where"] == {"0": 0, "2": 1, "5": 2}
    # rank 0's samples are 0-3: rows 3 (from rank 0) and 2 (from rank 1); rank 1's are 4-7
    assert r0["back"][2:] == [[20.0, 2.0, 0.0], [30.0, 3.0, 0.0]]  # padded to the local width, 3
    assert r1["back"][2:] == [[60.0, 6.0, 0.0], [70.0, 7.0, 0.0]]
