"""Shared test helpers: run a script on N ranks (gloo on CPU) with torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

RunRanks = Callable[..., subprocess.CompletedProcess[str]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# torchrun's own store could not listen on the port free_port() found: another process (a test of the other worker, an
# engine) took it in between, before any rank started (seen in CI: EADDRINUSE at the agent's rendezvous)
PORT_TAKEN = "The server socket has failed to listen on any local network address"


def run_ranks(args: Sequence[str], *, nproc: int, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node=nproc <args>`` on a free local port, 1 torch thread per rank; launched again on
    another port (up to 3 tries) when the port was taken before any rank started.

    ``args`` is what follows torchrun's options: a script path or ``-m module``, then its arguments.
    Raises with the ranks' output when they fail.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        if not (proc.returncode != 0 and PORT_TAKEN in proc.stderr and "EADDRINUSE" in proc.stderr):
            break
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    return proc


@pytest.fixture(scope="session")
def torchrun() -> RunRanks:
    return run_ranks


def make_discriminating(model_dir: Path, seed: int) -> Path:
    """Redraw every 1-D tensor (norms ≈ 1 ± 0.2, biases ≈ ±0.1) and scale q/k projections ×8.

    ``make_tiny_model`` draws norms = 1, biases = 0 and N(0, 0.02²) matrices (nearly uniform
    attention), which would hide a misplaced norm or QKV bias, a wrong RoPE θ/scaling or position.
    """
    path = model_dir / "model.safetensors"
    state = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if t.ndim == 1:
            noise = torch.randn(t.shape, generator=gen)
            state[name] = noise * 0.1 if name.endswith("bias") else 1 + 0.2 * noise
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            state[name] = t * 8
    save_file(state, path, metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="session")
def discriminate() -> Callable[[Path, int], Path]:
    """:func:`make_discriminating`, for conftests and tests in subfolders."""
    return make_discriminating


def area_of(nodeid: str) -> str:
    """The part of the suite a test belongs to: its folder under ``tests/`` (``tests/rollout/engines``), ``tests``
    for a file at the root, or its plugin (``plugins/hybridrl-math-reward``)."""
    parts = nodeid.split("::")[0].split("/")
    if parts[0] == "plugins":
        return "/".join(parts[:2])
    folder = parts[:-1]
    return "/".join(folder[:3]) if folder else "tests"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Where the suite's time went, by area (setup + call + teardown of every test, summed over the workers): the
    table to read when the CI budget is tight, next to ``--durations``' slowest tests."""
    seconds: dict[str, float] = {}
    tests: dict[str, set[str]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call", "teardown"):
                continue
            area = area_of(report.nodeid)
            seconds[area] = seconds.get(area, 0.0) + float(getattr(report, "duration", 0.0))
            tests.setdefault(area, set()).add(report.nodeid)
    if not seconds:
        return
    total = sum(seconds.values())
    terminalreporter.write_sep("=", f"time by area ({total / 60:.1f} worker-minutes in all)")
    for area, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{s / 60:7.1f} min {100 * s / total:5.1f} %  {len(tests[area]):4d} tests  {area}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that launches ranks or an engine's processes is ``slow`` too: the quick tier (``-m "not slow"``, in
    the README) leaves out everything that takes more than a few seconds."""
    for item in items:
        if any(item.get_closest_marker(m) for m in ("distributed", "sglang", "vllm")):
            item.add_marker(pytest.mark.slow)
