"""Third-party plugins made by a test: a distribution written to disk and pip-installed into a site dir of its own,
as ``pip install`` would put a real one (entry points in its metadata); put the site on ``PYTHONPATH`` (or
``sys.path``) to see its plugins."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def pip_install(src: Path, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--no-compile", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True,
    )


def write_dist(root: Path, dist: str, module: str, group: str, entries: dict[str, str], body: str) -> Path:
    """A distribution ``dist`` of one module (``body``) declaring ``entries`` in entry-point group ``group``."""
    (root / module).mkdir(parents=True)
    (root / module / "__init__.py").write_text(textwrap.dedent(body))
    eps = "\n".join(f'{k} = "{v}"' for k, v in entries.items())
    (root / "pyproject.toml").write_text(textwrap.dedent(f"""\
        [build-system]
        requires = ["setuptools>=69"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{dist}"
        version = "9.9.1"
        [project.entry-points."{group}"]
        """) + eps + f'\n[tool.setuptools]\npackages = ["{module}"]\n')
    return root


def installed_plugin(tmp: Path, module: str, group: str, entries: dict[str, str], body: str) -> Path:
    """The site dir under ``tmp`` where module ``module`` (``body``) is installed with its ``entries``."""
    src = write_dist(tmp / "src", "hybridrl-" + module.replace("_", "-"), module, group, entries, body)
    pip_install(src, tmp / "site")
    return tmp / "site"
