"""``hybridrl verify-model``: is the Megatron model built from an HF checkpoint the same model?

For each checkpoint, on ``tp × pp`` ranks that it launches itself (torchrun; gloo on CPU): build the
Megatron model (``vpp`` interleaved model chunks per stage when given; uneven end stages with
``--first-stage-layers``/``--last-stage-layers``), load the HF weights, run the
same token ids through it (Megatron's forward-only pipeline schedule) and through transformers
(``AutoModelForCausalLM``, fp32, eager attention), then export the weights back through the bucketed
stream and compare every tensor bit for bit with the safetensors original, on every rank. A block-wise FP8
checkpoint (:mod:`hybridrl.hf.fp8`) is compared dequantised, both ways: transformers gets a dequantised fp32 copy.
The last line printed is ``max_abs_logit_diff=<float> roundtrip=<exact|MISMATCH>`` (the worst over the checkpoints
given).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridrl.hf.arch import WEIGHT_FILES, HFArch
from hybridrl.hf.tensors import SafetensorsReader

DEFAULT_BUCKET_BYTES = 32 << 20


@dataclasses.dataclass(slots=True, kw_only=True)
class ModelReport:
    model_dir: str
    max_abs_logit_diff: float
    roundtrip_exact: bool
    mismatches: list[str]  # first few names that differ, are missing or unexpected
    n_tensors: int
    buckets: list[tuple[int, int]]  # (tensors, bytes) per bucket in stream order, as rank 0 got them
    bucket_bytes: int
    seconds: dict[str, float]
    stage_layers: list[int] = dataclasses.field(default_factory=list)  # layers each pipeline stage built


class VerifyError(RuntimeError):
    pass


def check_model_dir(model_dir: Path) -> HFArch:
    """Raise with what is missing unless ``model_dir`` is a HF checkpoint of a supported family."""
    if not model_dir.is_dir():
        raise VerifyError(f"{model_dir}: not a directory (expected a HF checkpoint directory)")
    if not (model_dir / "config.json").is_file():
        raise VerifyError(f"{model_dir}: no config.json (a HF checkpoint directory holds config.json "
                          f"and {' or '.join(WEIGHT_FILES)})")
    if not any((model_dir / name).is_file() for name in WEIGHT_FILES):
        raise VerifyError(f"{model_dir}: no weights (expected {' or '.join(WEIGHT_FILES)})")
    try:
        return HFArch.from_hf(model_dir)
    except (KeyError, ValueError, NotImplementedError) as e:
        raise VerifyError(str(e.args[0]) if e.args else str(e)) from None  # KeyError's str() adds quotes


def run_verification(
    model_dirs: list[Path],
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    etp: int | None = None,
    first: int | None = None,
    last: int | None = None,
    seq_len: int = 16,
    batch: int = 2,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout_s: float = 900.0,
) -> list[ModelReport]:
    """Check each checkpoint on the fewest ranks that hold the layout (``tp × pp × ep`` unless ``etp``, the experts'
    own TP, is below ``tp``: then EP spans the TP ranks too), launched once for all of them (``ep``: the experts of
    an MoE model split over that many ranks, which are data-parallel replicas for the rest; ``first``/``last``: the
    layers of the first/last pipeline stage, an uneven split, :mod:`hybridrl.megatron.stages`)."""
    if vpp is not None and (vpp < 2 or pp < 2):
        raise VerifyError(f"--vpp {vpp} needs --pp ≥ 2 and a value ≥ 2 (leave it out for one model chunk per stage)")
    for model_dir in model_dirs:
        check_model_dir(model_dir).check_split(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, first=first, last=last)
    ranks = pp * math.lcm(tp, ep * (tp if etp is None else etp))
    with tempfile.TemporaryDirectory(prefix="hybridrl-verify-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "hybridrl.megatron.verify", "--worker", f"--report={report}", f"--tp={tp}", f"--pp={pp}",
            f"--ep={ep}", f"--etp={etp or 0}", f"--first={first or 0}", f"--last={last or 0}",
            f"--vpp={vpp or 0}", f"--seq-len={seq_len}", f"--batch={batch}", f"--bucket-bytes={bucket_bytes}",
            *[str(d) for d in model_dirs],
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        returncode = _run_process_group(cmd, env=env, timeout_s=timeout_s)
        if returncode is None:
            raise VerifyError(f"the {ranks} verification rank(s) did not finish within --timeout-s "
                              f"{timeout_s:g}; they were stopped (raise --timeout-s for a large checkpoint)")
        if returncode != 0 or not report.is_file():
            raise VerifyError(f"the {ranks} verification rank(s) failed (exit code {returncode}); "
                              "see their output above")
        reports = json.loads(report.read_text())
        return [ModelReport(**{**r, "buckets": [tuple(b) for b in r["buckets"]]}) for r in reports]


def _run_process_group(cmd: list[str], *, env: dict[str, str], timeout_s: float) -> int | None:
    """Run ``cmd`` (torchrun) as the leader of its own process group; its exit code, or None after
    ``timeout_s`` — then the whole group (torchrun *and* the ranks it spawned) gets SIGTERM, and SIGKILL
    5 s later. Killing only torchrun, as ``subprocess.run(timeout=)`` does, leaves the ranks running."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            if grace is not None:
                time.sleep(grace)
        proc.wait()
        return None
    except BaseException:  # Ctrl-C here: the ranks go too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise


def main(args: argparse.Namespace) -> int:
    """``hybridrl verify-model MODEL_DIR... [--tp N] [--pp N] [--vpp N] [--ep N] [--etp N]`` (arguments in
    :mod:`hybridrl.cli`)."""
    model_dirs = [Path(d) for d in args.model_dir]
    try:
        vpp = f", vpp={args.vpp}" if args.vpp else ""
        ep = f", ep={args.ep}" if args.ep > 1 else ""
        ep += f", etp={args.etp}" if args.etp is not None else ""
        ep += f", first stage {args.first_stage_layers} layers" if args.first_stage_layers else ""
        ep += f", last stage {args.last_stage_layers} layers" if args.last_stage_layers else ""
        ranks = args.pp * math.lcm(args.tp, args.ep * (args.tp if args.etp is None else args.etp))
        print(f"verify-model: {len(model_dirs)} checkpoint(s) on {ranks} rank(s) "
              f"(tp={args.tp}, pp={args.pp}{vpp}{ep}), {args.batch}×{args.seq_len} tokens", flush=True)
        reports = run_verification(model_dirs, tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp,
                                   first=args.first_stage_layers, last=args.last_stage_layers, seq_len=args.seq_len,
                                   batch=args.batch, bucket_bytes=args.bucket_bytes, timeout_s=args.timeout_s)
    except (VerifyError, ValueError) as e:
        print(f"verify-model: error: {e}", file=sys.stderr)
        return 2
    for r in reports:
        print(f"{r.model_dir}: max_abs_logit_diff={r.max_abs_logit_diff:.3e} "
              f"roundtrip={'exact' if r.roundtrip_exact else 'MISMATCH ' + ', '.join(r.mismatches)} "
              f"({r.n_tensors} tensors in {len(r.buckets)} buckets of ≤ {r.bucket_bytes} B"
              + (f"; layers per stage {' + '.join(map(str, r.stage_layers))}" if len(r.stage_layers) > 1 else "")
              + ")")
    worst = max(r.max_abs_logit_diff for r in reports)
    exact = all(r.roundtrip_exact for r in reports)
    print(f"max_abs_logit_diff={worst:.3e} roundtrip={'exact' if exact else 'MISMATCH'}", flush=True)
    return 0 if worst <= args.tolerance and exact else 1  # NaN fails too


# --- the ranks ----------------------------------------------------------------------------------


def _worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hybridrl.megatron.verify --worker")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--report", type=Path, required=True)
    for name in ("--tp", "--pp", "--vpp", "--ep", "--etp", "--first", "--last", "--seq-len", "--batch",
                 "--bucket-bytes"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("model_dirs", nargs="+", type=Path)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    from hybridrl.megatron.parallel import ParallelConfig, destroy_parallel, init_parallel, seed_everything

    torch.set_num_threads(1)
    parallel = ParallelConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                              virtual_pipeline_model_parallel_size=args.vpp or None,  # 0: none
                              expert_model_parallel_size=args.ep,
                              expert_tensor_parallel_size=args.etp or None)  # 0: the model's TP
    init_parallel(parallel)
    seed_everything(0)
    reports = [dataclasses.asdict(_verify_one(d, parallel, args)) for d in args.model_dirs]
    if dist.get_rank() == 0:
        args.report.write_text(json.dumps(reports))
    destroy_parallel()
    return 0


def _log(msg: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"verify-model: {msg}", flush=True)


def _verify_one(model_dir: Path, parallel: Any, args: argparse.Namespace) -> ModelReport:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hybridrl.megatron.model import build_model_chunks, padded_vocab_size, unwrap_model
    from hybridrl.megatron.stages import FIRST, LAST
    from hybridrl.megatron.weights import load_hf_weights

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    arch = HFArch.from_hf(model_dir)
    padded = padded_vocab_size(arch.vocab_size, args.tp)
    _log(f"{model_dir}: building Megatron GPTModel ({arch.family}, {arch.num_layers} layers, hidden "
         f"{arch.hidden_size}, {arch.num_attention_heads} heads / {arch.num_query_groups} KV groups, vocab "
         f"{arch.vocab_size} padded to {padded}, {'tied' if arch.tie_word_embeddings else 'untied'} "
         "embeddings) and loading its weights")
    stages = {k: n for k, n in ((FIRST, args.first), (LAST, args.last)) if n}  # 0: even
    chunks = build_model_chunks(arch, parallel, overrides=stages)
    load_hf_weights(chunks, arch, model_dir)
    for chunk in chunks:
        chunk.eval()
    tower = None
    if arch.vision is not None:  # a VLM: its vision tower beside the language model, an image in every row
        from hybridrl.vlm.megatron_vlm import build_vision_tower

        tower = build_vision_tower(arch, model_dir)
    stage_layers: list[int] = [0] * args.pp
    dist.all_gather_object(stage_layers, sum(len(unwrap_model(c).decoder.layers) for c in chunks),
                           group=parallel_state.get_pipeline_model_parallel_group())
    seconds["build_load"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(1234)
    ids_BS = torch.randint(0, arch.vocab_size, (args.batch, args.seq_len), generator=gen)
    _log(f"forward {args.batch}×{args.seq_len} tokens through Megatron and transformers")
    device = next(chunks[0].parameters()).device
    if tower is not None:
        from hybridrl.vlm.verify_vlm import hf_vlm_logits, vlm_forward, vlm_inputs

        ids_BS, pixels, grid = vlm_inputs(arch, batch=args.batch, seq_len=args.seq_len, gen=gen)
        ids = ids_BS.to(device)
        logits_BSV = megatron_logits(chunks, arch, ids, pp=args.pp,
                                     forward=vlm_forward(tower, arch, ids, pixels, grid))
        hf_logits = lambda: hf_vlm_logits(model_dir, arch, ids_BS, pixels, grid)  # noqa: E731
    else:
        logits_BSV = megatron_logits(chunks, arch, ids_BS.to(device), pp=args.pp)
        hf_logits = lambda: _hf_logits(model_dir, ids_BS, arch.fp8_blocks)  # noqa: E731
    diff = torch.zeros((), device=device)
    if logits_BSV is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        diff = (logits_BSV - hf_logits().to(device)).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    seconds["forward"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    _log(f"exporting the weights as HF tensors (buckets ≤ {args.bucket_bytes} B) and comparing them "
         "bit for bit with the safetensors originals")
    mismatches, n_tensors, buckets = _roundtrip(chunks, arch, model_dir, args.bucket_bytes, tower=tower)
    bad = torch.tensor(float(len(mismatches)), device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    seconds["export"] = time.perf_counter() - t0
    return ModelReport(model_dir=str(model_dir), max_abs_logit_diff=float(diff),
                       roundtrip_exact=bad.item() == 0, mismatches=mismatches[:5], n_tensors=n_tensors,
                       buckets=buckets, bucket_bytes=args.bucket_bytes, seconds=seconds, stage_layers=stage_layers)


def megatron_logits(chunks: list[Any], arch: HFArch, ids_BS: Any, *, pp: int,
                    forward: Callable[[Any, Any, Any], Any] | None = None) -> Any:
    """Full-vocab logits ``[b, s, V]`` on the last pipeline stage (None elsewhere), on the model's device;
    ``forward(model, ids, mask)`` runs a chunk (None: with ``arange`` positions; a VLM gives its own).

    The interleaved schedule (several chunks) needs a multiple of PP micro-batches: the same one is
    fed PP times and the first output is taken.
    """
    import torch
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from hybridrl.megatron.cpu import causal_attention_mask
    from hybridrl.megatron.model import gather_vocab_logits

    b, s = ids_BS.shape
    position_ids_BS = torch.arange(s, device=ids_BS.device).expand(b, s)
    mask = causal_attention_mask(s, ids_BS.device)

    def forward_step(data_iterator: Any, model: Any) -> tuple[Any, Any]:
        ids = next(data_iterator)
        output = model(ids, position_ids_BS, mask) if forward is None else forward(model, ids, mask)
        return output, lambda out, non_loss_data=True: out

    n_micro = pp if len(chunks) > 1 else 1
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter([ids_BS] * n_micro) for _ in chunks],
            model=chunks, num_microbatches=n_micro, seq_length=s, micro_batch_size=b, forward_only=True,
            collect_non_loss_data=True,
        )
        if not parallel_state.is_pipeline_last_stage():
            return None
        return gather_vocab_logits(outputs[0], arch.vocab_size)


def _hf_logits(model_dir: Path, ids_BS: Any, fp8_blocks: tuple[int, int] | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        if fp8_blocks is not None:
            model_dir = _dequantised_copy(model_dir, fp8_blocks, Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")  # CPU
    with torch.no_grad():
        return hf.eval()(ids_BS).logits


def _dequantised_copy(model_dir: Path, fp8_blocks: tuple[int, int], out: Path) -> Path:
    """``model_dir``'s FP8 weights dequantised into fp32, without quantization_config, in ``out``: transformers on
    CPU dequantises to bf16 only, and refuses a weight that ends in a partial block (transformers 5.19
    ``Fp8Dequantize._dequantize_one``: "not divisible by scale grid"), as DeepSeek-V3's 576-row kv_a_proj does."""
    from safetensors.torch import save_file

    with SafetensorsReader(model_dir, fp8_blocks=fp8_blocks) as reader:
        save_file({n: reader.read(n).contiguous() for n in reader.files}, str(out / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    return out


def _roundtrip(
    chunks: list[Any], arch: HFArch, model_dir: Path, bucket_bytes: int, *, tower: Any = None
) -> tuple[list[str], int, list[tuple[int, int]]]:
    """Every exported tensor against the checkpoint's, bit for bit (a VLM's ``tower``: its weights as one more
    bucket)."""
    import itertools

    import torch

    from hybridrl.megatron.weights import export_hf_weights
    from hybridrl.vlm.megatron_vlm import vision_tensors

    mismatches: list[str] = []
    seen: set[str] = set()
    buckets: list[tuple[int, int]] = []
    with SafetensorsReader(model_dir, fp8_blocks=arch.fp8_blocks) as reader:  # FP8: dequantised
        stream = export_hf_weights(chunks, arch, bucket_bytes=bucket_bytes)
        for bucket in itertools.chain(stream, [vision_tensors(tower, arch)] if tower is not None else []):
            buckets.append((len(bucket), sum(t.numel() * t.element_size() for _, t in bucket)))
            for name, tensor in bucket:
                if name in seen or name not in reader.files:
                    mismatches.append(f"{name} (unexpected or repeated)")
                    continue
                seen.add(name)
                original = reader.read(name)
                exported = tensor.cpu().to(original.dtype)  # bf16 → fp32 model → bf16 is lossless
                same = exported.shape == original.shape and torch.equal(
                    exported.contiguous().view(torch.uint8), original.contiguous().view(torch.uint8))
                if not same:
                    mismatches.append(name)
        mismatches += [f"{name} (missing)" for name in sorted(set(reader.files) - seen)]
    return mismatches, len(seen), buckets


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
