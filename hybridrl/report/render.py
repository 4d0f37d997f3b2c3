"""Figures drawn with matplotlib (Agg: no display needed), one PNG per figure, runs overlaid by colour.

Per-step curves are drawn raw (faint) under an exponential moving average (``smooth`` = TensorBoard's
weight: ``s_t = w·s_{t-1} + (1-w)·x_t``; 0 draws the raw curve only). Sparse series (evaluations, and
anything logged on fewer than half the steps) are drawn as points joined by lines, and curves of fewer than
20 points as they are: neither is smoothed.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridrl.report.panels import STEP_TIME, Figure, Panel, stage_keys
from hybridrl.report.runs import Run

if TYPE_CHECKING:
    from matplotlib.axes import Axes

INSTALL = "pip install 'hybridrl[report]'  (or: pip install matplotlib)"
LINESTYLES = ("-", "--", ":", "-.")


class MissingMatplotlib(RuntimeError):
    pass


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or an error saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise MissingMatplotlib(f"hybridrl report draws with matplotlib, which is not installed: {INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(kw_only=True, slots=True)
class Rendered:
    figure: Figure
    png: bytes | None  # None: no panel of the figure had data
    notes: list[str] = field(default_factory=list)


def ema(values: list[float], weight: float) -> list[float]:
    out, s = [], None
    for v in values:
        s = v if s is None else weight * s + (1 - weight) * v
        out.append(s)
    return out


MIN_SMOOTHED = 20  # shorter curves are drawn raw: an EMA over a handful of points mostly shows its lag


def _sparse(steps: list[int]) -> bool:
    return len(steps) < 3 or len(steps) < 0.5 * (steps[-1] - steps[0] + 1)


def _smoothed(steps: list[int], smooth: float) -> bool:
    return smooth > 0 and len(steps) >= MIN_SMOOTHED and not _sparse(steps)


def _has_data(panel: Panel, run: Run) -> bool:
    if panel.kind != "line":
        return bool(run.series(STEP_TIME)[0]) and bool(stage_keys(run.keys))
    return any(run.series(k)[0] for k in panel.keys)


def render(figure: Figure, runs: list[Run], colors: dict[str, Any], *, smooth: float, dpi: int = 110) -> Rendered:
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    notes: list[str] = []
    panels: list[tuple[Panel, Run | None]] = []  # a time split gets one axes per run
    for panel in figure.panels:
        having = [r for r in runs if _has_data(panel, r)]
        if not having:
            notes.append(f"{panel.title}: not logged ({', '.join(panel.keys)})")
            continue
        if len(having) < len(runs):
            notes.append(f"{panel.title}: not logged by {', '.join(r.name for r in runs if r not in having)}")
        panels += [(panel, r) for r in having] if panel.kind == "time_split" else [(panel, None)]
    if not panels:
        return Rendered(figure=figure, png=None, notes=notes)
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.2 * rows + 0.5), squeeze=False, layout="constrained")
    stages = sorted({s for r in runs for s in stage_keys(r.keys)})
    stage_colors: dict[str, Any] = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(stages)}
    stage_colors["other"] = "0.75"
    for ax, (panel, run) in zip(axes.flat, panels, strict=False):
        if panel.kind == "time_split":
            assert run is not None
            _time_split(ax, run, stage_colors, smooth=smooth)
            ax.set_title(f"{panel.title}: {run.name}", fontsize=9)
        elif panel.kind == "time_bars":
            _time_bars(ax, runs, stage_colors)
            ax.set_title(panel.title, fontsize=9)
        else:
            _lines(ax, panel, runs, colors, smooth=smooth)
            ax.set_title(panel.title, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if panel.kind != "time_bars":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=colors[r.name], lw=2) for r in runs]
    fig.legend(handles, [r.name for r in runs], loc="outside upper center", ncol=min(len(runs), 5), fontsize=9,
               frameon=False)
    fig.suptitle(figure.title, x=0.01, ha="left", fontsize=11, fontweight="bold")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return Rendered(figure=figure, png=buf.getvalue(), notes=notes)


def _lines(ax: Axes, panel: Panel, runs: list[Run], colors: dict[str, Any], *, smooth: float) -> None:
    drawn: list[str] = []
    for run in runs:
        color = colors[run.name]
        for i, key in enumerate(panel.keys):
            steps, values = run.series(key)
            if not steps:
                continue
            style = LINESTYLES[i % len(LINESTYLES)]
            if key not in drawn:
                drawn.append(key)
            if not (panel.smooth and _smoothed(steps, smooth)):
                ax.plot(steps, values, style, color=color, lw=1.3, marker="o" if _sparse(steps) else None, ms=3)
            else:
                ax.plot(steps, values, style, color=color, lw=0.8, alpha=0.25)
                ax.plot(steps, ema(values, smooth), style, color=color, lw=1.5)
            if i == 0 and panel.band is not None:
                lo, hi = (dict(zip(*run.series(k), strict=True)) for k in panel.band)
                both = [s for s in steps if s in lo and s in hi]
                if both:
                    ax.fill_between(both, [lo[s] for s in both], [hi[s] for s in both], color=color, alpha=0.12,
                                    lw=0)
    if len(drawn) > 1:  # which line style is which key
        ax.legend([ax.plot([], [], LINESTYLES[panel.keys.index(k) % len(LINESTYLES)], color="0.3")[0]
                   for k in drawn], [k.split("/", 1)[-1] for k in drawn], fontsize=7, frameon=False, loc="best")
    ax.set_xlabel("step", fontsize=8)


def _time_split(ax: Axes, run: Run, stage_colors: dict[str, Any], *, smooth: float) -> None:
    """Stacked seconds per stage along the run; ``other`` = the step's time outside the named stages."""
    steps, total = run.series(STEP_TIME)
    stages = stage_keys(run.keys)
    per_stage = {s: dict(zip(*run.series(s), strict=True)) for s in stages}
    layers = [[per_stage[s].get(step, 0.0) for step in steps] for s in stages]
    other = [max(t - sum(layer[i] for layer in layers), 0.0) for i, t in enumerate(total)]
    layers.append(other)
    if _smoothed(steps, smooth):
        layers = [ema(layer, smooth) for layer in layers]
    names = [*stages, "other"]
    ax.stackplot(steps, layers, labels=[n.removeprefix("timing/") for n in names],
                 colors=[stage_colors[n] for n in names], alpha=0.85)
    ax.legend(fontsize=6, frameon=False, loc="upper left", ncol=2)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("s", fontsize=8)


def _time_bars(ax: Axes, runs: list[Run], stage_colors: dict[str, Any]) -> None:
    """One horizontal bar per run: its mean seconds per step, split by stage."""
    having = [r for r in runs if r.series(STEP_TIME)[0]]
    for y, run in enumerate(having):
        steps, total = run.series(STEP_TIME)
        left = 0.0
        for s in stage_keys(run.keys):
            _, vals = run.series(s)
            mean = sum(vals) / len(steps)
            ax.barh(y, mean, height=0.6, left=left, color=stage_colors[s],
                    label=s.removeprefix("timing/") if y == 0 else None)
            left += mean
        other = max(sum(total) / len(steps) - left, 0.0)
        ax.barh(y, other, height=0.6, left=left, color=stage_colors["other"], label="other" if y == 0 else None)
    ax.set_yticks(range(len(having)), [r.name for r in having], fontsize=8)
    ax.set_xlabel("s", fontsize=8)
    ax.set_ylim(len(having) - 0.5, -0.9 - 0.25 * len(stage_colors) / 4)  # room above the bars for the legend
    ax.legend(fontsize=6, frameon=False, loc="upper center", ncol=4)
