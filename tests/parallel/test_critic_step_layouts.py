"""One critic step gives the same answer at every parallel layout as on one rank (TP=1).

The step is ``workers/critic_step.py``'s (also under the interleaved schedule): the values pass, then the
clipped value loss over 2 mini-batches × 2–4 micro-batches with the DP-global token-mean normaliser, with Adam
and with SGD. Compared with the single-rank run: every response token's value, every optimizer step's metrics,
and every trunk and head tensor after the step (the worker also checks that the replicated head is identical
on TP peers). The max abs differences reached are printed per layout (``pytest -s``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_rl_step_layouts import TOL, data_parallel_size

WORKER = str(Path(__file__).parent / "workers" / "critic_step.py")
OPTIMIZERS = ("adam", "sgd")
METRICS = ("vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm")
WEIGHT_TOL = {"adam": TOL["weights"]["token-mean"], "sgd": TOL["weights"]["seq-mean-token-mean"]}  # the actor's
LAUNCHES = {  # name -> (ranks, layouts run in one torchrun launch; DP is what the world leaves)
    "2ranks": (2, ["tp2pp1cp1", "tp1pp2cp1", "tp1pp1cp1", "tp1pp1cp2"]),  # TP=2, PP=2, DP=2, CP=2
    "4ranks": (4, ["tp2pp2cp1"]),  # TP×PP: the head on the last stage, replicated over its TP pair
    "vpp": (2, ["tp1pp2cp1vpp2"]),  # interleaved 1F1B: the head on the last chunk of the last stage
    "dyn": (2, ["tp1pp2cp1-dyn", "tp1pp1cp1-dyn"]),  # token-budget micro-batches of differing shapes, PP=2 / DP=2
    # the layouts above pack each micro-batch in one row (use_remove_padding, the default), the reference too; these
    # pad a row per sample: packed values and updates equal padded ones at TP=2, CP=2 and with token budgets at PP=2
    "padded": (2, ["tp2pp1cp1-pad", "tp1pp1cp2-pad", "tp1pp2cp1-dyn-pad"]),
}


@pytest.fixture(scope="module")
def reference(torchrun, rl_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("critic_step")
    torchrun([WORKER, str(rl_model), str(out), "tp1pp1cp1"], nproc=1)
    return out


@pytest.fixture(scope="module")
def launched(torchrun, rl_model: Path, reference: Path) -> Callable[[str], list[str]]:
    """Runs a launch's layouts once; the layouts of every launch of one world size in a single torchrun (each
    launch's process start and Megatron import cost ~8 s)."""
    done: set[int] = set()

    def launch(name: str) -> list[str]:
        nproc, layouts = LAUNCHES[name]
        if nproc not in done:
            same_world = dict.fromkeys(x for n, ls in LAUNCHES.values() if n == nproc for x in ls)
            torchrun([WORKER, str(rl_model), str(reference), *same_world], nproc=nproc, timeout=900)
            done.add(nproc)
        return layouts

    return launch


def max_abs_diffs(ref: dict, got: dict) -> dict[str, float]:
    diffs = {"values": float((ref["values"] - got["values"]).abs().max())}
    assert len(ref["steps"]) == len(got["steps"]) == 2
    for k in METRICS:  # relative above 1 (a grad norm of ~18 carries float32 noise of a few 1e-6)
        diffs[k] = max(abs(a[k] - b[k]) / max(1.0, abs(a[k])) for a, b in zip(ref["steps"], got["steps"], strict=True))
    assert ref["weights"].keys() == got["weights"].keys() and "score.weight" in ref["weights"]
    for part, is_head in (("trunk", False), ("head", True)):
        diffs[part] = max(float((ref["weights"][k] - got["weights"][k]).abs().max())
                          for k in ref["weights"] if k.startswith("score.") == is_head)
    return diffs


@pytest.mark.distributed
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_critic_step_matches_single_rank(launched: Callable[[str], list[str]], reference: Path, launch: str) -> None:
    nproc = LAUNCHES[launch][0]
    failures = []
    for layout in launched(launch):
        dp = data_parallel_size(layout, nproc)
        for opt in OPTIMIZERS:
            ref = torch.load(reference / f"tp1pp1cp1dp1-{opt}.pt")
            got = torch.load(reference / f"{layout}dp{dp}-{opt}.pt")
            assert ref["steps"][0]["vf_clipfrac"] == 0 < ref["steps"][1]["vf_clipfrac"]  # V = V_old, then clipped
            assert float(ref["values"].abs().max()) > 0.01  # the head reads something
            diffs = max_abs_diffs(ref, got)
            print(f"{layout}dp{dp} {opt:>4}: " + " ".join(f"{k}={v:.1e}" for k, v in diffs.items()))
            for k, v in diffs.items():
                tol = WEIGHT_TOL[opt] if k in ("trunk", "head") else TOL["logprobs" if k == "values" else "metrics"]
                if not v <= tol:
                    failures.append(f"{layout}dp{dp} {opt} {k}: max |Δ| {v:.2e} > {tol:.0e}")
    assert not failures, "\n".join(failures)
