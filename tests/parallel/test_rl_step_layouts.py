"""One actor RL step gives the same answer at every parallel layout as on one rank (TP=1).

The step is the trainer's (``workers/rl_step.py``): old and ref log-probs, then PPO-clip + KL loss
+ entropy bonus over 2 mini-batches × 2–4 micro-batches with the DP-global normaliser, for
``token-mean`` (Adam) and ``seq-mean-token-mean`` (SGD). Compared with the single-rank run: the
old/ref log-probs and entropy of every response token, every optimizer step's metrics and every
HF tensor exported after the step. The max abs differences reached are printed per layout
(``pytest -s``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

WORKER = str(Path(__file__).parent / "workers" / "rl_step.py")
MODES = ("token-mean", "seq-mean-token-mean")
METRICS = ("pg_loss", "grad_norm", "ppo_kl", "clipfrac", "kl_ref", "entropy")
# fp32 reassociation only (TP splits matmuls and softmax sums; DP, PP and CP change summation orders).
# Seen: ≤ 5e-7 on log-probs, ≤ 7e-7 on metrics, ≤ 2e-7 on SGD weights, ≤ 2e-6 on Adam weights
# (Adam's first steps divide by |g| + eps, which amplifies noise on near-zero gradient entries).
TOL = {"logprobs": 2e-6, "metrics": 2e-6, "weights": {"token-mean": 1e-5, "seq-mean-token-mean": 1e-6}}
LAUNCHES = {  # name -> (ranks, layouts run in one torchrun launch; DP is what the world leaves)
    "2ranks": (2, ["tp2pp1cp1", "tp1pp2cp1", "tp1pp1cp1", "tp1pp1cp2"]),  # TP=2, PP=2, DP=2, CP=2
    "4ranks": (4, ["tp2pp2cp1", "tp2pp1cp1", "tp2pp1cp2", "tp1pp2cp2"]),  # TP×PP, DP×TP, TP×CP, PP×CP (2 each)
    # interleaved 1F1B: 2 stages × 2 chunks of 1 layer (rank 0: layers 0, 2; rank 1: layers 1, 3), tied
    # embeddings between chunk 0 of rank 0 and chunk 1 of rank 1
    "vpp": (2, ["tp1pp2cp1vpp2", "tp1pp2cp1vpp2-dyn"]),  # packed token budgets too: one length per pass on gloo
    # Megatron's distributed optimizer (Adam only: no SGD mode) at DP=2, next to plain DP=2
    "distopt": (2, ["tp1pp1cp1", "tp1pp1cp1-distopt"]),
    # token-budget micro-batches of differing shapes (use_dynamic_bsz) under PP=2 and under DP=2
    "dyn": (2, ["tp1pp2cp1-dyn", "tp1pp1cp1-dyn"]),
    # shared-prompt rows (use_prefix_grouper) under TP=2, under PP=2 with token budgets that cut a prompt's
    # samples into two rows, and under DP=2
    "prefix": (2, ["tp2pp1cp1-pg", "tp1pp2cp1-dyn-pg", "tp1pp1cp1-pg"]),
    # the fused LM head (log-probs from hidden states × the output weight): under PP=2 (the tied output weight
    # is the last stage's copy) and CP=2 (hidden states sharded along the sequence)
    "lmhead": (2, ["tp1pp2cp1-lmh", "tp1pp1cp2-lmh"]),
    # every layout above packs each micro-batch into one row (use_remove_padding, the default), the reference too;
    # these pad a row per sample (or per shared-prompt group): packing on equals packing off at TP=2, PP=2 and CP=2
    "padded": (2, ["tp2pp1cp1-pad", "tp1pp2cp1-pad", "tp1pp1cp2-pad", "tp1pp2cp1-dyn-pg-pad"]),
}


@pytest.fixture(scope="module")
def reference(torchrun, rl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("rl_step")
    torchrun([WORKER, str(rl_model), str(out), "tp1pp1cp1"], nproc=1)
    return out


def max_abs_diffs(ref: dict, got: dict) -> dict[str, float]:
    """Max |Δ| per quantity: per-token tensors, each metric over the optimizer steps, all weights."""
    diffs = {k: float((ref[k] - got[k]).abs().max()) for k in ("old_logprobs", "ref_logprobs", "entropy")}
    assert len(ref["steps"]) == len(got["steps"]) == 2
    for k in METRICS:
        diffs[k] = max(abs(a[k] - b[k]) for a, b in zip(ref["steps"], got["steps"], strict=True))
    assert ref["weights"].keys() == got["weights"].keys()
    diffs["weights"] = max(float((ref["weights"][k] - got["weights"][k]).abs().max()) for k in ref["weights"])
    return diffs


@pytest.fixture(scope="module")
def launched(torchrun, rl_model: Path, reference: Path) -> Callable[[str], list[str]]:
    """Runs a launch's layouts once (into the reference's folder); returns them. The layouts of every launch of
    one world size run in a single torchrun (each launch's process start and Megatron import cost ~8 s)."""
    done: set[int] = set()

    def launch(name: str) -> list[str]:
        nproc, layouts = LAUNCHES[name]
        if nproc not in done:
            same_world = dict.fromkeys(x for n, ls in LAUNCHES.values() if n == nproc for x in ls)
            torchrun([WORKER, str(rl_model), str(reference), *same_world], nproc=nproc, timeout=900)
            done.add(nproc)
        return layouts

    return launch


def modes(layout: str) -> tuple[str, ...]:
    return MODES[:1] if layout.endswith("-distopt") else MODES  # the distributed optimizer: Adam only


def data_parallel_size(layout: str, nproc: int) -> int:
    match = re.match(r"tp(\d+)pp(\d+)cp(\d+)", layout)
    assert match, layout
    tp, pp, cp = (int(g) for g in match.groups())
    return nproc // (tp * pp * cp)


@pytest.mark.distributed
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_rl_step_matches_single_rank(launched: Callable[[str], list[str]], reference: Path, launch: str) -> None:
    nproc = LAUNCHES[launch][0]
    failures = []
    for layout in launched(launch):
        dp = data_parallel_size(layout, nproc)
        for mode in modes(layout):
            ref = torch.load(reference / f"tp1pp1cp1dp1-{mode}.pt")
            got = torch.load(reference / f"{layout}dp{dp}-{mode}.pt")
            assert all(abs(s["ppo_kl"]) < 1e-6 for s in (ref["steps"][0], got["steps"][0]))  # on-policy
            assert ref["steps"][1]["clipfrac"] > 0 and ref["steps"][1]["kl_ref"] > 0  # both exercised
            diffs = max_abs_diffs(ref, got)
            print(f"{layout}dp{dp} {mode:>19}: " + " ".join(f"{k}={v:.1e}" for k, v in diffs.items()))
            for k, v in diffs.items():
                tol = TOL["weights"][mode] if k == "weights" else TOL["logprobs" if k.endswith(
                    ("logprobs", "entropy")) and k not in METRICS else "metrics"]
                if not v <= tol:
                    failures.append(f"{layout}dp{dp} {mode} {k}: max |Δ| {v:.2e} > {tol:.0e}")
    assert not failures, "\n".join(failures)


@pytest.mark.distributed
def test_distributed_optimizer_matches_plain_data_parallel(launched: Callable[[str], list[str]],
                                                           reference: Path) -> None:
    """Same DP=2 step with Megatron's optimizer state sharded over DP (reduce-scatter of the grads, each
    rank updates its shard, all-gather of the weights) and replicated (all-reduce, full update)."""
    plain, sharded = launched("distopt")
    got = torch.load(reference / f"{sharded}dp2-token-mean.pt")
    diffs = max_abs_diffs(torch.load(reference / f"{plain}dp2-token-mean.pt"), got)
    print(f"{sharded}dp2 vs {plain}dp2: " + " ".join(f"{k}={v:.1e}" for k, v in diffs.items()))
    assert all(v <= TOL["weights"]["token-mean"] if k == "weights" else v <= TOL["metrics"]
               for k, v in diffs.items()), diffs
    assert got["steps"][1]["grad_norm"] > 1.0  # clip_grad=1.0 was applied, over the sharded grads
