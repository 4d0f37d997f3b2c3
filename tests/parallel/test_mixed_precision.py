"""Mixed precision (``megatron.dtype``) and activation recompute (``megatron.override_transformer_config``)
on the trainer's RL step (``workers/precision.py`` runs ``rl_step.py``'s step: old/ref log-probs, 2 PPO
mini-batch updates with Adam (``token-mean``) and SGD (``seq-mean-token-mean``)).

bf16 / fp16 against fp32 on the same batch, at TP=1 (Megatron's ``Float16OptimizerWithFloat16Params``),
DP=2 with the distributed optimizer (fp32 main-weight shards) and TP=2 (vocab-parallel logits in bf16).
Tolerances, with ``u`` the dtype's unit roundoff (bf16 2⁻⁸ ≈ 3.9e-3: 8 significand bits; fp16 2⁻¹¹ ≈ 4.9e-4):

- per-token log-probs and entropies: |Δ| ≤ u · max|value| — each is a difference of logits of that size,
  computed from weights and activations that are each rounded to the dtype (relative error ≤ u; a few
  roundings in a row). Seen: 0.25–0.36 of it;
- the losses (each optimizer step's metrics) are token means of O(1) terms (group-normalised advantages ×
  ratios ≈ 1, KL and entropy terms ≤ O(1)): |Δ| ≤ u. Seen: ≤ 0.11 u (bf16), ≤ 0.3 u (fp16);
- grad norm: relative |Δ| ≤ 4u (the gradient entries carry a few u each). Seen: ≤ 0.55 u (bf16), 1.2 u (fp16);
- the update, measured on the optimizer's fp32 main weights (the bf16 parameters can't even represent
  it: near 1 a bf16 step is 2⁻⁸–2⁻⁷, the Adam update 1e-3): Δ = main weights after − start (the start is
  the HF weights rounded to the dtype); ‖Δ − Δ_fp32‖ / ‖Δ_fp32‖ ≤ 8u for SGD, whose update is lr × the
  (clipped) gradient, so it carries the gradient's relative error (seen: 2.8–2.9 u); ≤ 0.25 for Adam, whose
  first updates are ≈ lr · sign(g): an entry whose gradient is within rounding noise of 0 flips (an error
  of 2·lr), so this bounds the flipped share of the update below ~1.6 % (seen: 7.6 % bf16 → 0.14 % of it
  flipped; 1.5 % fp16).
The parameters are the main weights rounded to the dtype, exactly. fp16 runs with Megatron's dynamic loss
scale (2¹⁶ to start): no step is skipped.

These bounds hold for a smooth objective: the runs clip the PPO ratio only far outside every ratio of the
step (clipfrac 0, asserted). With rl_step's ±0.02 one token of the second mini-batch lay within bf16 rounding
of the edge; on an AVX2 CPU (oneDNN's bf16 GEMMs round differently from AVX-512-BF16) it was clipped at TP=2
bf16 and not in fp32, and its gradient vanished: grad norm 9.3 u, SGD update 33 u off.

A bf16 checkpoint under the distributed optimizer resumes bitwise (the fp32 main weights are in it), and
``export-hf`` writes the bf16 parameters. Activation recompute (full: uniform and block; selective: core
attention + MLP) gives bitwise the same step as none, at TP=1 and PP=2, and runs the recomputed modules
twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

WORKER = str(Path(__file__).parent / "workers" / "precision.py")
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODES = ("token-mean", "seq-mean-token-mean")  # Adam, SGD
UPDATE_TOL = {"token-mean": lambda u: 0.25, "seq-mean-token-mean": lambda u: 8 * u}
LOSSES = ("pg_loss", "kl_ref", "ppo_kl", "entropy")
LAUNCHES = {  # name -> (ranks, runs)
    "1rank": (1, ["tp1pp1cp1.float32", "tp1pp1cp1.bfloat16", "tp1pp1cp1.float16", "tp1pp1cp1.float32.recompute",
                  "tp1pp1cp1.float32.selective"]),
    "2ranks": (2, ["tp1pp1cp1-distopt.float32", "tp1pp1cp1-distopt.bfloat16", "tp1pp1cp1-distopt.float16",
                   "tp2pp1cp1.bfloat16", "tp1pp1cp1-distopt.bfloat16.resume", "tp1pp2cp1.float32",
                   "tp1pp2cp1.float32.recompute", "tp1pp2cp1.float32.block"]),
}
# (16-bit run, its fp32 reference): the same layout, or TP=1 for TP=2 (fp32 reassociation there is ~1e-6)
PRECISION = [("tp1pp1cp1.bfloat16", "tp1pp1cp1.float32"), ("tp1pp1cp1.float16", "tp1pp1cp1.float32"),
             ("tp1pp1cp1-distopt.bfloat16", "tp1pp1cp1-distopt.float32"),
             ("tp1pp1cp1-distopt.float16", "tp1pp1cp1-distopt.float32"), ("tp2pp1cp1.bfloat16", "tp1pp1cp1.float32")]
RECOMPUTE = [("tp1pp1cp1.float32.recompute", "tp1pp1cp1.float32"), ("tp1pp1cp1.float32.selective", "tp1pp1cp1.float32"),
             ("tp1pp2cp1.float32.recompute", "tp1pp2cp1.float32"), ("tp1pp2cp1.float32.block", "tp1pp2cp1.float32")]


@pytest.fixture(scope="module")
def runs(torchrun: Callable[..., Any], rl_model: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Launches the launch that holds a run once (~30 s each); returns the folder of its results."""
    out = tmp_path_factory.mktemp("precision")
    done: set[str] = set()

    def launched(run: str) -> Path:
        name = next(n for n, (_, names) in LAUNCHES.items() if run in names)
        if name not in done:
            nproc, names = LAUNCHES[name]
            torchrun([WORKER, str(rl_model), str(out), *names], nproc=nproc, timeout=600)
            done.add(name)
        return out

    return launched


def modes(run: str) -> tuple[str, ...]:
    return MODES[:1] if "-distopt" in run else MODES  # the distributed optimizer: Adam only


def load(runs: Callable[[str], Path], run: str, mode: str) -> dict[str, Any]:
    return torch.load(runs(run) / f"{run}-{mode}.pt")


def update_error(start: dict[str, torch.Tensor], ref: dict[str, Any], got: dict[str, Any],
                 dtype: torch.dtype) -> float:
    """‖Δ − Δ_ref‖ / ‖Δ_ref‖ over all weights, Δ = main weights after the step − start (rounded to ``dtype``)."""
    err = norm = 0.0
    for name, w0 in start.items():
        d_ref = ref["main_weights"][name] - w0
        d_got = got["main_weights"][name] - w0.to(dtype).float()
        err += float((d_got - d_ref).pow(2).sum())
        norm += float(d_ref.pow(2).sum())
    return (err / norm) ** 0.5


@pytest.mark.distributed
@pytest.mark.parametrize(("run", "reference"), PRECISION)
def test_16_bit_step_matches_fp32_within_rounding(runs: Callable[[str], Path], rl_model: Path, run: str,
                                                  reference: str) -> None:
    dtype_name = run.split(".")[1]
    u, dtype = UNIT_ROUNDOFF[dtype_name], DTYPES[dtype_name]
    start = load_file(rl_model / "model.safetensors")
    failures = []
    for mode in modes(run):
        ref, got = load(runs, reference, mode), load(runs, run, mode)
        diffs = {}
        for key in ("old_logprobs", "ref_logprobs", "entropy"):
            diffs[key] = (float((got[key] - ref[key]).abs().max()), u * float(ref[key].abs().max()))
        steps = list(zip(ref["steps"], got["steps"], strict=True))
        for key in LOSSES:
            diffs[f"step_{key}"] = (max(abs(a[key] - b[key]) for a, b in steps), u)
        diffs["grad_norm"] = (max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in steps), 4 * u)
        diffs["update"] = (update_error(start, ref, got, dtype), UPDATE_TOL[mode](u))
        print(f"{run} vs {reference} {mode}: " + " ".join(f"{k}={v:.1e}/{tol:.0e}" for k, (v, tol) in diffs.items()))
        failures += [f"{mode} {k}: {v:.2e} > {tol:.1e}" for k, (v, tol) in diffs.items() if not v <= tol]

        # the objective is smooth where it is compared (precision.PRECISION_CLIP): a token at a clip edge would
        # turn the comparison into one of which tokens are clipped
        assert all(s["clipfrac"] == 0.0 for s in ref["steps"] + got["steps"]), "a token reached the clip range"
        for step in got["steps"]:  # finite, applied; fp16: the loss scale never overflowed
            assert step["update_skipped"] == 0.0 and torch.isfinite(torch.tensor(step["pg_loss"]))
            assert step.get("loss_scale") == (2.0**16 if dtype == torch.float16 else None)
        assert all(w.dtype == dtype for w in got["weights"].values())  # weight sync and HF saving stream these
        for name, main in got["main_weights"].items():
            assert main.dtype == torch.float32
            assert torch.equal(got["weights"][name], main.to(dtype)), f"{name}: parameters ≠ main weights in {dtype}"
            assert not torch.equal(main, start[name].to(dtype).float()), f"{name} was not updated"
    assert not failures, f"{run} vs {reference}:\n" + "\n".join(failures)


@pytest.mark.distributed
def test_bf16_distributed_optimizer_checkpoint_resumes_bitwise(runs: Callable[[str], Path]) -> None:
    """Step 1, checkpoint, step 2 — against a fresh actor that loads the checkpoint and takes step 2: the
    same metrics and, bit for bit, the same bf16 parameters and fp32 main weights (DP=2, each rank's shard
    of the main weights and Adam state comes back)."""
    run = "tp1pp1cp1-distopt.bfloat16.resume"
    saved = torch.load(runs(run) / f"{run}.pt")
    a, b = saved["uninterrupted"], saved["resumed"]
    assert a["metrics"] == b["metrics"] and a["metrics"]["update_skipped"] == 0.0
    for key in ("weights", "main_weights"):
        assert a[key].keys() == b[key].keys()
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    assert all(not torch.equal(saved["fresh_main_weights"][k], a["main_weights"][k]) for k in a["main_weights"])


@pytest.mark.distributed
def test_export_hf_writes_bf16_parameters_of_a_bf16_checkpoint(runs: Callable[[str], Path],
                                                                tmp_path: Path) -> None:
    """``export-hf`` builds the model in the dtype the checkpoint's parameters were saved in and writes them
    as they are (the bf16 parameters, not the fp32 main weights)."""
    run = "tp1pp1cp1-distopt.bfloat16.resume"
    saved = torch.load(runs(run) / f"{run}.pt")
    cmd = [sys.executable, "-m", "hybridrl.cli", "export-hf", saved["checkpoint"], str(tmp_path / "hf")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported, expected = load_file(tmp_path / "hf" / "model.safetensors"), saved["weights_at_checkpoint"]
    assert exported.keys() == expected.keys()
    assert all(exported[k].dtype == torch.bfloat16 and torch.equal(exported[k], expected[k]) for k in expected)


@pytest.mark.distributed
@pytest.mark.parametrize(("run", "reference"), RECOMPUTE)
def test_activation_recompute_is_exact(runs: Callable[[str], Path], run: str, reference: str) -> None:
    """Recompute reruns the same forward from the saved layer inputs (same RNG states, no dropout): every
    log-prob, metric and weight after the step is bitwise the one without it; the hooks see the recomputed
    modules run twice."""
    kind = run.rsplit(".", 1)[1]
    for mode in MODES:
        ref, got = load(runs, reference, mode), load(runs, run, mode)
        for key in ("old_logprobs", "ref_logprobs", "entropy"):
            assert torch.equal(ref[key], got[key]), key
        assert ref["steps"] == got["steps"]
        assert all(torch.equal(ref["weights"][k], got["weights"][k]) for k in ref["weights"])
        plain, twice = ref["forwards"], got["forwards"]
        assert plain["layer"] > 0 and plain["layer"] == plain["core_attention"] == plain["mlp"]
        expected = {  # layers per stage: 4 at TP=1, 2 at PP=2 (block recomputes the first of each stage)
            "recompute": {k: 2 * v for k, v in plain.items()},
            "block": {k: v * 3 // 2 for k, v in plain.items()},
            "selective": {"layer": plain["layer"], "core_attention": 2 * plain["core_attention"],
                          "mlp": 2 * plain["mlp"]},
        }[kind]
        assert twice == expected, (kind, plain, twice)
