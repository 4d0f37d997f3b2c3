"""``hybridrl report RUN [RUN …] --out report.html|DIR|FILE.png``: a run's curves as a self-contained HTML page
(PNGs embedded, no network) or as PNG files, several runs overlaid by name.

Reads each run's ``metrics.jsonl`` (:mod:`hybridrl.report.runs`), draws the figures of
:mod:`hybridrl.report.panels` with matplotlib (:mod:`hybridrl.report.render`, the optional extra
``hybridrl[report]``). Works on a run that is still going: its partial last line is left out.
"""

from __future__ import annotations

import argparse
import base64
import html
import sys
import time
from pathlib import Path

from hybridrl.report.panels import figures
from hybridrl.report.render import MissingMatplotlib, Rendered, pyplot, render
from hybridrl.report.runs import Run, age, load_runs


def build(runs: list[Run], *, smooth: float, only: list[str] | None = None) -> list[Rendered]:
    keys = set().union(*(r.keys for r in runs))
    figs = figures(keys)
    if only:
        unknown = sorted(set(only) - {f.name for f in figs})
        if unknown:
            raise ValueError(f"--figures: no figure {unknown} for these runs; valid: {', '.join(f.name for f in figs)}")
        figs = [f for f in figs if f.name in only]
    cmap = pyplot().get_cmap("tab10")
    colors = {r.name: cmap(i % 10) for i, r in enumerate(runs)}
    return [render(f, runs, colors, smooth=smooth) for f in figs]


def write_html(path: Path, runs: list[Run], rendered: list[Rendered]) -> None:
    now = time.time()
    rows = "".join(
        f"<tr><td>{html.escape(r.name)}</td><td><code>{html.escape(str(r.path))}</code></td><td>{len(r.rows)}</td>"
        f"<td>{r.last_step if r.last_step is not None else '–'}</td><td>{age(r, now)} ago</td>"
        f"<td>{'<br>'.join(html.escape(n) for n in r.notes)}</td></tr>" for r in runs)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>hybridrl report: "
             f"{html.escape(', '.join(r.name for r in runs))}</title><style>"
             "body{font-family:sans-serif;margin:1.5em;max-width:1500px} img{max-width:100%}"
             "table{border-collapse:collapse;font-size:90%} "
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
             ".note{color:#666;font-size:85%}</style></head><body>",
             f"<h1>hybridrl report</h1><p class='note'>written {time.strftime('%Y-%m-%d %H:%M:%S')}</p>"
             "<table><tr><th>run</th><th>metrics file</th><th>rows</th><th>last step</th><th>last written</th>"
             f"<th>notes</th></tr>{rows}</table>"]
    for r in rendered:
        parts.append(f"<h2 id='{r.figure.name}'>{html.escape(r.figure.title)}</h2>")
        if r.png is not None:
            data = base64.b64encode(r.png).decode("ascii")
            parts.append(f"<img alt='{html.escape(r.figure.title)}' src='data:image/png;base64,{data}'>")
        if r.notes:
            parts.append("<ul class='note'>" + "".join(f"<li>{html.escape(n)}</li>" for n in r.notes) + "</ul>")
    parts.append("</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts), encoding="utf-8")


def write_pngs(out: Path, rendered: list[Rendered]) -> list[Path]:
    """``out`` is a directory (one ``<figure>.png`` each) or, for a single figure, a ``.png`` file."""
    drawn = [r for r in rendered if r.png is not None]
    if out.suffix == ".png":
        if len(drawn) != 1:
            raise ValueError(f"--out {out}: a .png file holds one figure, got {len(drawn)}; choose one with "
                             "--figures or give a directory")
        targets = [(out, drawn[0])]
    else:
        targets = [(out / f"{r.figure.name}.png", r) for r in drawn]
    written = []
    for path, r in targets:
        assert r.png is not None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(r.png)
        written.append(path)
    return written


def main(args: argparse.Namespace) -> int:
    try:
        if not 0 <= args.smooth < 1:
            raise ValueError(f"--smooth {args.smooth}: an EMA weight in [0, 1) (0: raw curves only)")
        runs = load_runs([Path(p) for p in args.runs], args.name)
        figs = args.figures.split(",") if args.figures else None
        rendered = build(runs, smooth=args.smooth, only=figs)
    except (MissingMatplotlib, FileNotFoundError, ValueError) as e:
        print(f"hybridrl report: {e}", file=sys.stderr)
        return 2
    for run in runs:
        print(f"{run.name}: {len(run.rows)} rows, last step {run.last_step}, written {age(run)} ago ({run.path})")
        for note in run.notes:
            print(f"  note: {note}")
    for r in rendered:
        for note in r.notes:
            print(f"  {r.figure.name}: {note}")
    if not any(r.png is not None for r in rendered):
        print("nothing to draw yet: no run has logged a step with metrics")
    out = Path(args.out)
    if out.suffix == ".html":
        write_html(out, runs, rendered)
        print(f"wrote {out} ({sum(r.png is not None for r in rendered)} figures)")
    else:
        try:
            written = write_pngs(out, rendered)
        except ValueError as e:
            print(f"hybridrl report: {e}", file=sys.stderr)
            return 2
        if written:
            print("wrote " + ", ".join(str(p) for p in written))
    return 0
