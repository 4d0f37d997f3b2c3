"""``hybridrl verify-model``: Megatron logits match transformers and the weight export round-trips
bit for bit, at TP=1, TP=2, PP=2, TP=2×PP=2 and PP=2×VPP=2 (interleaved: layers 0, 2 on rank 0 and 1, 3
on rank 1), and PP=2×VPP=2 with uneven stages (2 layers first). One launch of the ranks per layout checks all of
its checkpoints (Megatron's import costs ~10 s per process)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hybridrl.cli import build_parser
from hybridrl.megatron import verify
from hybridrl.megatron.verify import ModelReport, run_verification

ALL = ["qwen2_tied", "qwen2_untied", "qwen3", "llama_sharded", "odd_vocab", "heads8_kv4", "qwen3_head_dim",
       "llama3_rope"]
LAYOUTS: dict[str, tuple[int, int, int | None, list[str]]] = {  # tp, pp, vpp, checkpoints
    "tp1": (1, 1, None, [*ALL, "extra_tensor"]),
    "tp2": (2, 1, None, ["qwen2_tied", "qwen2_untied", "qwen3", "llama_sharded", "odd_vocab", "heads8_kv4",
                   "qwen3_head_dim"]),
    "pp2": (1, 2, None, ["qwen2_tied", "qwen2_untied", "qwen3", "llama_sharded", "odd_vocab", "llama3_rope"]),
    "tp2pp2": (2, 2, None, ["qwen2_tied", "odd_vocab"]),
    "pp2vpp2": (1, 2, 2, ["qwen2_tied", "qwen2_untied", "qwen3"]),  # 4 layers: one per model chunk
}
CASES = [(layout, name) for layout, (_, _, _, names) in LAYOUTS.items() for name in names if name != "extra_tensor"]
BUCKET_BYTES = 150_000  # the tiny models' fc1 halves (196 kB) exceed it, their q/k/v (128 kB) fit together
LAST_LINE = re.compile(r"max_abs_logit_diff=(\S+) roundtrip=(exact|MISMATCH)")


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adds a checkpoint with one tensor no model parameter maps to: the round trip must flag it."""
    extra = tmp_path_factory.mktemp("extra_tensor")
    for f in tiny_checkpoints["qwen2_tied"].iterdir():
        (extra / f.name).write_bytes(f.read_bytes())
    state = load_file(extra / "model.safetensors")
    state["model.extra_buffer"] = state["model.norm.weight"].clone()
    save_file(state, extra / "model.safetensors", metadata={"format": "pt"})
    return {**tiny_checkpoints, "extra_tensor": extra}


@pytest.fixture(scope="module")
def reports(checkpoints: dict[str, Path]) -> Callable[[str], dict[str, ModelReport]]:
    cache: dict[str, dict[str, ModelReport]] = {}

    def layout_reports(layout: str) -> dict[str, ModelReport]:
        if layout not in cache:
            tp, pp, vpp, names = LAYOUTS[layout]
            got = run_verification([checkpoints[n] for n in names], tp=tp, pp=pp, vpp=vpp,
                                   bucket_bytes=BUCKET_BYTES)
            cache[layout] = dict(zip(names, got, strict=True))
        return cache[layout]

    return layout_reports


@pytest.mark.distributed
@pytest.mark.parametrize(("layout", "model"), CASES)
def test_logits_match_transformers_and_export_round_trips(
    reports: Callable[[str], dict[str, ModelReport]], layout: str, model: str
) -> None:
    report = reports(layout)[model]
    assert report.max_abs_logit_diff <= 1e-5
    assert report.roundtrip_exact, report.mismatches


@pytest.mark.distributed
def test_round_trip_flags_a_tensor_the_model_does_not_have(
    reports: Callable[[str], dict[str, ModelReport]]
) -> None:
    report = reports("tp1")["extra_tensor"]
    assert not report.roundtrip_exact
    assert report.mismatches == ["model.extra_buffer (missing)"]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_buckets_respect_bucket_bytes(reports: Callable[[str], dict[str, ModelReport]], layout: str) -> None:
    for name, report in reports(layout).items():
        assert sum(n for n, _ in report.buckets) == report.n_tensors, name
        for n_tensors, nbytes in report.buckets:  # only a tensor larger than the bound travels alone
            assert nbytes <= BUCKET_BYTES or n_tensors == 1, (name, n_tensors, nbytes)
    buckets = [b for r in reports(layout).values() for b in r.buckets]
    assert any(n > 1 for n, _ in buckets) and any(size > BUCKET_BYTES for _, size in buckets)


@pytest.mark.distributed
def test_cli_prints_the_verdict_last(checkpoints: dict[str, Path]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "verify-model", str(checkpoints["qwen3"]), "--tp", "2"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines[0].startswith("verify-model: 1 checkpoint(s) on 2 rank(s)")
    match = LAST_LINE.fullmatch(lines[-1])
    assert match and float(match[1]) <= 1e-5 and match[2] == "exact", lines[-1]


def _verify_workers() -> list[str]:
    """Command lines of the live verify-model ranks on this machine."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if b"hybridrl.megatron.verify" in argv and b"--worker" in argv:
            found.append(" ".join(a.decode(errors="replace") for a in argv))
    return found


@pytest.mark.distributed
def test_timeout_stops_every_rank(checkpoints: dict[str, Path]) -> None:
    """Reproduces: ``subprocess.run(timeout=)`` killed torchrun only and its 2 ranks kept running."""
    assert _verify_workers() == []
    proc = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "verify-model", str(checkpoints["qwen3"]), "--tp", "2",
         "--timeout-s", "4"],  # the ranks are still importing Megatron (~10 s)
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "did not finish within --timeout-s 4; they were stopped" in proc.stderr
    assert _verify_workers() == []  # the CLI returned after the whole process group was gone


def _run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


def test_cli_exit_code_reflects_tolerance_and_round_trip(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def fake(diff: float, exact: bool) -> Callable[..., list[ModelReport]]:
        return lambda dirs, **kw: [ModelReport(
            model_dir=str(dirs[0]), max_abs_logit_diff=diff, roundtrip_exact=exact, mismatches=[],
            n_tensors=1, buckets=[(1, 4)], bucket_bytes=8, seconds={})]

    for diff, exact, code, verdict in [(1e-6, True, 0, "exact"), (1e-3, True, 1, "exact"),
                                       (float("nan"), True, 1, "exact"), (0.0, False, 1, "MISMATCH")]:
        monkeypatch.setattr(verify, "run_verification", fake(diff, exact))
        assert _run_cli(["verify-model", str(tmp_path)]) == code
        assert capsys.readouterr().out.strip().splitlines()[-1] == (
            f"max_abs_logit_diff={diff:.3e} roundtrip={verdict}")


def test_cli_explains_a_dir_that_is_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli(["verify-model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert _run_cli(["verify-model", str(tmp_path)]) == 2
    assert "no weights (expected model.safetensors or model.safetensors.index.json)" in capsys.readouterr().err


def test_cli_explains_a_virtual_pipeline_without_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run_cli(["verify-model", str(tmp_path), "--vpp", "2"]) == 2
    assert "--vpp 2 needs --pp ≥ 2" in capsys.readouterr().err


@pytest.mark.distributed
def test_uneven_stages_under_the_interleaved_schedule_are_exact(tmp_path: Path,
                                                                discriminate: Callable[[Path, int], Path]) -> None:
    """PP=2 × VPP=2 with two layers on the first stage (``num_layers_in_first_pipeline_stage``): a 6-layer Qwen3 is
    built as chunks [0] [3] on stage 0 and [1, 2] [4, 5] on stage 1 (Megatron's interleaved offsets,
    hybridrl.megatron.stages), and still gives transformers' logits and a bitwise round trip. ~10 s: one launch."""
    from hybridrl.models.tiny import make_tiny_model

    model = discriminate(make_tiny_model(tmp_path / "six", arch="qwen3", layers=6, seed=3), 3)
    (report,) = run_verification([model], pp=2, vpp=2, first=2, bucket_bytes=BUCKET_BYTES)
    print(f"pp2 vpp2 first=2: max_abs_logit_diff={report.max_abs_logit_diff:.3g}, {report.stage_layers}")
    assert report.max_abs_logit_diff <= 1e-5 and report.roundtrip_exact, report
    assert report.stage_layers == [2, 4]


def test_cli_refuses_an_uneven_split_the_model_cannot_take(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--first-stage-layers``/``--last-stage-layers`` are checked against the checkpoint before any rank starts."""
    config = {"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: refused first
    assert _run_cli(["verify-model", str(tmp_path), "--pp", "2", "--first-stage-layers", "2",
                     "--last-stage-layers", "2"]) == 2
    assert ("num_layers_in_first_pipeline_stage=2: the two stages at PP=2 hold all 3 layers: 2 + 2 must equal it; "
            "valid: [1]") in capsys.readouterr().err
