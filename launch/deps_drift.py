"""What a fresh, unconstrained resolve of the README's install would change, against constraints.txt and this
environment: the scheduled-style check of the pins (run it by hand or from a cron job; it needs the registries).

    python launch/deps_drift.py [--strict]

It asks pip to resolve ``.[test]`` and the two plugins' requirements as a fresh machine without
``-c constraints.txt`` would (``pip install --dry-run --ignore-installed --report``; nothing is installed) and
prints one line per package whose fresh version differs from the one installed here, marking those that
constraints.txt pins. ``--strict`` exits 1 when there is any (for a scheduled job that opens an issue); the
default exits 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLUGINS = ["plugins/hybridrl-math-reward", "plugins/hybridrl-length-reward"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    """``name==version`` lines of a constraints file, by canonical name (comments and blanks skipped)."""
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[canonical(name)] = version.strip()
    return out


def plugin_requirements() -> list[str]:
    """The plugins' own third-party requirements (pip resolves ``hybridrl`` itself from ``.``)."""
    import tomllib

    reqs = []
    for plugin in PLUGINS:
        project = tomllib.loads((REPO / plugin / "pyproject.toml").read_text())["project"]
        reqs += [r for r in project.get("dependencies", []) if canonical(re.split(r"[<>=!~;\[ ]", r)[0]) != "hybridrl"]
    return reqs


def fresh_resolve() -> dict[str, str]:
    """Package → version that pip would install on a fresh machine, unconstrained."""
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--disable-pip-version-check", "--report", str(report), ".[test]", *plugin_requirements()],
                       cwd=REPO, check=True)
        return resolved(json.loads(report.read_text()))


def resolved(report: dict) -> dict[str, str]:
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in report.get("install", [])}


def drift(fresh: dict[str, str], installed: dict[str, str], pinned: dict[str, str]) -> list[str]:
    """One line per package whose fresh version is not the installed one (new packages included)."""
    lines = []
    for name in sorted(fresh):
        now, new = installed.get(name), fresh[name]
        if now is not None and now.split("+")[0] == new.split("+")[0]:
            continue
        held = f"  (constraints.txt pins {pinned[name]})" if name in pinned else ""
        lines.append(f"{name}: {now or 'not installed'} → {new}{held}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strict", action="store_true", help="exit 1 when a fresh resolve would change anything")
    a = ap.parse_args()
    print("[deps_drift] resolving the README's install without constraints (pip --dry-run) …", file=sys.stderr)
    installed: dict[str, str] = {}
    for d in md.distributions():  # the first on sys.path is what `import` finds (a vendored copy may follow)
        installed.setdefault(canonical(d.metadata["Name"]), d.version)
    lines = drift(fresh_resolve(), installed, pins((REPO / "constraints.txt").read_text()))
    print("\n".join(lines) if lines else "a fresh resolve installs exactly what is installed here")
    print(f"[deps_drift] {len(lines)} package(s) would change", file=sys.stderr)
    return 1 if a.strict and lines else 0


if __name__ == "__main__":
    sys.exit(main())
