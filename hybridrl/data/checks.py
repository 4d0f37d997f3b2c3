"""What ``hybridrl validate`` (and so every run, before anything is built) checks of a local data file without
reading its rows: that it can be read, that it has rows, and that the columns the config names are there.

- parquet: the footer only (``pyarrow.parquet.ParquetFile``): schema and row count;
- jsonl: one streaming pass over the bytes — every line must be UTF-8 (a bad byte is named by line and column) —
  and the first non-blank line, the first row, is parsed for its keys (the other rows are not parsed).

Files that the run builds itself (``data.build_if_missing``) are checked once they exist; ``hf://`` datasets are
not opened here. What only reading every row finds (an over-long prompt, a bad row further down) is a
:class:`~hybridrl.config.errors.DataError` when the run reads it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from hybridrl.config.errors import DataError
from hybridrl.data.rows import decode_line

_checked: dict[tuple[str, int, int, tuple[tuple[str, str], ...]], list[str]] = {}  # a run validates twice


def file_problems(path: str, *, columns: Mapping[str, str]) -> list[str]:
    """What is wrong with the data file ``path`` (empty: nothing); ``columns``: config key → the column it names
    (a dotted key is a path into nested columns). The file must exist."""
    p = Path(path)
    stat = p.stat()
    memo = (str(p.resolve()), stat.st_size, stat.st_mtime_ns, tuple(sorted(columns.items())))
    if memo not in _checked:
        _checked[memo] = _parquet_problems(p, columns) if p.suffix == ".parquet" else _jsonl_problems(p, columns)
    return list(_checked[memo])


def _parquet_problems(path: Path, columns: Mapping[str, str]) -> list[str]:
    import pyarrow as pa  # here: validation without local data files never imports pyarrow
    import pyarrow.parquet as pq

    try:
        footer = pq.ParquetFile(path)
        schema, rows = footer.schema_arrow, footer.metadata.num_rows
    except (OSError, ValueError, pa.ArrowException) as e:
        return [f"not a readable parquet file ({type(e).__name__}: {e})"]
    if rows == 0:
        return [f"has no rows (its columns: {schema.names})"]
    missing = []
    for config_key, column in columns.items():
        node: pa.Schema | pa.StructType | None = schema
        for part in column.split("."):
            if node is None:  # below a column that is not a struct (a map, JSON text): the rows will tell
                break
            if node.get_field_index(part) < 0:
                missing.append(f"has no column {column!r} ({config_key}); its columns: {schema.names}")
                break
            t = node.field(part).type
            node = t if isinstance(t, pa.StructType) else None
    return missing


def _jsonl_problems(path: Path, columns: Mapping[str, str]) -> list[str]:
    first, first_line = None, 0
    try:
        with path.open("rb") as f:
            for line_no, raw in enumerate(f, start=1):
                line = decode_line(raw, path=path, line_no=line_no)
                if first is None and line.strip():
                    first, first_line = line, line_no
    except DataError as e:
        return [str(e).removeprefix(f"{path} ")]
    except OSError as e:
        return [f"cannot be read ({type(e).__name__}: {e})"]
    if first is None:
        return ["has no rows: the file is empty" if path.stat().st_size == 0 else "has no rows: every line is blank"]
    try:
        row = json.loads(first)
    except json.JSONDecodeError as e:
        return [f"line {first_line}, the first row, is not JSON ({e})"]
    if not isinstance(row, dict):
        return [f"line {first_line}, the first row, is not a JSON object but {type(row).__name__}"]
    missing = []
    for config_key, column in columns.items():
        node = row
        for part in column.split("."):
            if not isinstance(node, dict) or node.get(part) is None:
                missing.append(f"line {first_line}, the first row, has no key {column!r} ({config_key}); its keys: "
                               f"{sorted(row)}")
                break
            node = node[part]
    return missing
