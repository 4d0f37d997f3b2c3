"""Reproducible installs: the installed versions are constraints.txt's pins, and ``launch/deps_drift.py`` reads a
pip resolve report into what a fresh resolve would change."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("deps_drift", REPO / "launch" / "deps_drift.py")
assert spec is not None and spec.loader is not None
deps_drift = importlib.util.module_from_spec(spec)
spec.loader.exec_module(deps_drift)


def _imported_version(name: str) -> str:
    """The version of the distribution ``import`` finds first on sys.path, as ``importlib.metadata.version`` reads it.

    Not the last of ``md.distributions()``: setuptools >= 71 appends its ``_vendor`` folder (packaging 24.2,
    with its dist-info) to sys.path once imported, and CI saw that copy instead of site-packages' packaging 26.2.
    """
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def test_every_pinned_package_is_installed_at_its_pin() -> None:
    """The README's install (``-c constraints.txt`` throughout, the engine scripts too) gives the pinned versions."""
    import setuptools  # noqa: F401  (as some test on the same worker may: its _vendor joins sys.path)

    pinned = deps_drift.pins((REPO / "constraints.txt").read_text())
    assert len(pinned) >= 30 and {"torch", "transformers", "pytest", "datasets"} <= set(pinned)
    off = {n: (v, have) for n, v in pinned.items() if (have := _imported_version(n)).split("+")[0] != v}
    assert off == {}, off


def test_drift_lists_changed_and_new_packages_and_marks_the_pinned() -> None:
    report = {"install": [{"metadata": {"name": "Torch", "version": "2.14.1"}},
                          {"metadata": {"name": "tzdata", "version": "2026.6"}},
                          {"metadata": {"name": "py_yaml", "version": "6.0.3"}}]}
    fresh = deps_drift.resolved(report)
    assert fresh == {"torch": "2.14.1", "tzdata": "2026.6", "py-yaml": "6.0.3"}
    lines = deps_drift.drift(fresh, {"torch": "2.13.0+cpu", "py-yaml": "6.0.3"},
                             deps_drift.pins("torch==2.13.0  # the CPU build\n# x==1\n"))
    assert lines == ["torch: 2.13.0+cpu → 2.14.1  (constraints.txt pins 2.13.0)", "tzdata: not installed → 2026.6"]
