"""Read and write tables of rows (one dict per row) as parquet or jsonl, chosen by file suffix."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hybridrl.config.errors import DataError

Row = dict[str, Any]
SUFFIXES = (".parquet", ".jsonl")
# data.truncation (verl's values): what happens to a prompt over data.max_prompt_length when it is not dropped
TRUNCATIONS = ("error", "left", "right", "middle")


def read_rows(path: str | os.PathLike[str]) -> Iterator[tuple[int, Row]]:
    """``(row number, row)`` for every row of a parquet or jsonl file; rows are numbered from 0."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # here: static validation reads this module's rules, not parquet

        yield from enumerate(pq.read_table(path).to_pylist())
    elif path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    else:
        raise ValueError(f"data file {str(path)!r}: unsupported suffix {path.suffix!r}; valid: {SUFFIXES}")


def _read_jsonl(path: Path) -> Iterator[tuple[int, Row]]:
    row = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            line = decode_line(raw, path=path, line_no=line_no)
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {line_no} (row {row}): invalid JSON: {e}") from None
            if not isinstance(value, dict):
                raise DataError(f"{path} line {line_no} (row {row}): expected a JSON object, "
                                f"got {type(value).__name__}")
            yield row, value
            row += 1


def decode_line(raw: bytes, *, path: Path, line_no: int) -> str:
    """One jsonl line as text; a byte that is not UTF-8 is a :class:`DataError` naming the file, line and column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} line {line_no}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}; "
                        f"jsonl is UTF-8: re-encode the file, e.g. iconv -f latin1 -t utf-8 {path} > "
                        f"{path.with_suffix('.utf8.jsonl')})") from None


def write_rows(rows: Sequence[Row], path: str | os.PathLike[str]) -> Path:
    """Write ``rows`` to ``path`` (.parquet or .jsonl); parent directories are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), path)
    elif path.suffix == ".jsonl":
        with path.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    else:
        raise ValueError(f"cannot write {str(path)!r}: unsupported suffix {path.suffix!r}; valid: {SUFFIXES}")
    return path
