"""Where the rows of ``data.train_files`` / ``data.val_files`` come from: a file or a HF ``datasets`` split.

An entry is either a path to a ``.parquet`` / ``.jsonl`` file (read by :mod:`hybridrl.data.rows`) or
``hf://NAME[:CONFIG]:SPLIT`` / ``hf://NAME`` (split ``train``), read with ``datasets.load_dataset(NAME,
CONFIG, split=SPLIT)``. NAME is a hub id (``openai/gsm8k``) or a local dataset directory
(``hf:///data/gsm8k``, ``hf://./gsm8k``, which works offline); SPLIT may carry a slice (``test[:200]``;
quote it in a Hydra override: ``data.val_files=['hf://openai/gsm8k:main:test[:200]']``). The ``hf://``
prefix is required: a bare ``name:split`` is never guessed to be a dataset, so a typo in a file name
stays a "file does not exist" error. ``datasets`` is optional (``pip install hybridrl[data]``)
and imported only when an ``hf://`` entry is read.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hybridrl.data.rows import SUFFIXES, Row, read_rows

HF_PREFIX = "hf://"
HF_SYNTAX = "hf://NAME[:CONFIG][:SPLIT]"
VALID = f"a {' or '.join(SUFFIXES)} file, or {HF_SYNTAX} (a HF datasets hub id or local dataset directory)"
_HF = re.compile(r"(?P<name>[^:]+?)(?:(?::(?P<config>[\w.-]+))?:(?P<split>\w+(?:\[[^\]]*\])?))?")
_HUB_ID = re.compile(r"[\w.-]+(?:/[\w.-]+)?")
INSTALL_HINT = "it needs the optional `datasets` package: pip install 'hybridrl[data]' (or pip install datasets)"


@dataclass(frozen=True, slots=True, kw_only=True)
class HFSource:
    name: str  # hub id or local dataset directory
    config: str | None = None
    split: str = "train"

    @property
    def local(self) -> bool:
        return self.name.startswith(("/", ".", "~")) or Path(self.name).expanduser().exists()

    def __str__(self) -> str:
        return f"{HF_PREFIX}{self.name}{f':{self.config}' if self.config else ''}:{self.split}"


def is_hf(source: str) -> bool:
    return str(source).startswith(HF_PREFIX)


def parse_hf(source: str) -> HFSource:
    """The parts of ``hf://NAME[:CONFIG][:SPLIT]``; ValueError naming the valid form."""
    m = _HF.fullmatch(source.removeprefix(HF_PREFIX))
    if not is_hf(source) or m is None:
        raise ValueError(f"{source!r} is not {HF_SYNTAX} (e.g. hf://openai/gsm8k:main:train, hf:///data/math:test)")
    return HFSource(name=m["name"], config=m["config"], split=m["split"] or "train")


def source_problem(source: str) -> str | None:
    """What is wrong with the form of a data entry (no file is read, no network is used); None if nothing.

    A file's existence is not checked here: a file that the run builds first may not exist yet.
    """
    if not is_hf(source):
        suffix = Path(source).suffix
        return None if suffix in SUFFIXES else f"unsupported file type {suffix!r}; valid: {VALID}"
    try:
        hf = parse_hf(source)
    except ValueError as e:
        return str(e)
    if hf.local and not Path(hf.name).expanduser().is_dir():
        return f"no local dataset directory {hf.name!r}; valid: {VALID}"
    if not hf.local and not _HUB_ID.fullmatch(hf.name):
        return f"{hf.name!r} is neither a hub id (owner/name) nor an existing directory; valid: {VALID}"
    if importlib.util.find_spec("datasets") is None:
        return INSTALL_HINT
    return None


def source_stem(source: str) -> str:
    """A short name of the source: the file's stem, or the dataset's last path component."""
    if is_hf(source):
        return Path(parse_hf(source).name.rstrip("/")).name
    return Path(source).stem


def read_source(source: str) -> Iterator[tuple[int, Row]]:
    """``(row number, row)`` of every row of a data entry (see the module docstring), numbered from 0."""
    if not is_hf(source):
        yield from read_rows(source)
        return
    yield from enumerate(load_hf(parse_hf(source)))


def load_hf(hf: HFSource) -> Iterator[Row]:
    """The rows of one split through ``datasets.load_dataset``; unreachable or missing data is a clear error."""
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{hf}: {INSTALL_HINT}") from None
    name = str(Path(hf.name).expanduser()) if hf.local else hf.name
    try:
        ds = datasets.load_dataset(name, hf.config, split=hf.split)
    except (OSError, ValueError) as e:  # ConnectionError, DatasetNotFoundError, an unknown config or split
        where = "the local directory" if hf.local else "the HF hub (no network? a cached copy is used with " \
                                                        "HF_DATASETS_OFFLINE=1)"
        raise RuntimeError(f"cannot load {hf} from {where}: {type(e).__name__}: {e}. Offline, point at a "
                           f"local file or dataset directory instead") from e
    yield from ds
