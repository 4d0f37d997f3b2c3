"""``trainer.profile_steps``: a ``torch.profiler`` trace of chosen RL steps on every rank, and a top-ops table.

Each listed step's own work (generate … weight sync: what ``perf/tokens_per_s`` counts) runs under
``torch.profiler.profile`` (CPU activity, plus CUDA where a GPU is visible). Its trace goes to
``<trainer.output_dir>/profile/step_<k>.rank_<r>.json`` (Chrome trace format: open it in
https://ui.perfetto.dev or chrome://tracing). After the last listed step each rank writes its ops, summed over
the profiled steps and sorted by self time (CUDA's where present, else CPU's), to
``profile/top_ops.rank_<r>.txt``; rank 0 prints its table. The profiler only observes: a profiled run's
metrics and weights equal an unprofiled one's (tested).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from hybridrl.tracking import say


@dataclass(kw_only=True, slots=True)
class OpTotals:
    calls: int = 0
    self_cpu_us: float = 0.0
    self_device_us: float = 0.0


class StepProfiler:
    """``with profiler.step(k):`` around step ``k``'s work; a no-op for steps not in ``steps``."""

    def __init__(self, steps: Sequence[int], output_dir: str | Path, *, row_limit: int = 25) -> None:
        self.steps = sorted(set(steps))
        self.dir = Path(output_dir) / "profile"
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.cuda = torch.cuda.is_available()
        self.row_limit = row_limit
        self.totals: dict[str, OpTotals] = {}
        self.profiled: list[int] = []

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step not in self.steps:
            yield
            return
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if self.cuda else [])]
        with profile(activities=activities) as prof:
            yield
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"step_{step}.rank_{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        for e in prof.key_averages():
            t = self.totals.setdefault(e.key, OpTotals())
            t.calls += e.count
            t.self_cpu_us += e.self_cpu_time_total
            t.self_device_us += e.self_device_time_total
        self.profiled.append(step)
        say(f"profiled step {step}: trace {trace} (and one per rank)")
        if step == self.steps[-1]:
            table = self.table()
            path = self.dir / f"top_ops.rank_{self.rank}.txt"
            path.write_text(table + "\n")
            say(f"{table}\n(every rank's table: {self.dir}/top_ops.rank_<r>.txt)")

    def table(self) -> str:
        """The ops of the profiled steps by self time (device's when profiled on CUDA), ``row_limit`` rows."""
        by = "self_device_us" if self.cuda else "self_cpu_us"
        ops = sorted(self.totals.items(), key=lambda kv: getattr(kv[1], by), reverse=True)
        cpu_total = sum(t.self_cpu_us for t in self.totals.values()) or 1.0
        lines = [f"top ops of step(s) {self.profiled} on rank {self.rank}, by self {'CUDA' if self.cuda else 'CPU'} "
                 "time (summed over those steps):",
                 f"{'self CPU ms':>12} {'CPU %':>6}{' self CUDA ms' if self.cuda else ''} {'calls':>8}  op"]
        for name, t in ops[:self.row_limit]:
            cuda = f" {t.self_device_us / 1e3:12.2f}" if self.cuda else ""
            share = 100 * t.self_cpu_us / cpu_total
            lines.append(f"{t.self_cpu_us / 1e3:12.2f} {share:6.1f}{cuda} {t.calls:8d}  {name}")
        return "\n".join(lines)
