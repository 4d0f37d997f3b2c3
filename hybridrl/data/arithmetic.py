"""A synthetic verifiable task: multi-digit integer arithmetic (``12+34=`` → ``46``).

Problems are drawn without replacement from a seeded generator, so the train and test splits are
disjoint (no prompt string occurs twice). Rows have ``prompt``, ``ground_truth`` and ``data_source``
columns, the layout :class:`hybridrl.data.dataset.PromptDataset` reads by default.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hybridrl.data.rows import Row, write_rows

OPERATORS = ("+", "-", "*")


@dataclass(slots=True, kw_only=True, frozen=True)
class ArithmeticTaskConfig:
    min_digits: int = 1  # operands have between min_digits and max_digits digits
    max_digits: int = 2
    operators: list[str] = field(default_factory=lambda: ["+"])  # any of "+", "-", "*"
    nonnegative: bool = True  # order the operands of "-" so that answers are >= 0
    num_train: int = 1000
    num_test: int = 100
    seed: int = 0
    template: str = "{a}{op}{b}="  # prompt text; must use {a}, {op} and {b}
    data_source: str = "arithmetic"

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"min_digits={self.min_digits}, max_digits={self.max_digits}: "
                             f"need 1 <= min_digits <= max_digits")
        bad = [op for op in self.operators if op not in OPERATORS]
        if bad or not self.operators:
            raise ValueError(f"operators={self.operators!r}: need a non-empty subset of {list(OPERATORS)}")
        if self.num_train < 0 or self.num_test < 0:
            raise ValueError(f"num_train={self.num_train}, num_test={self.num_test} must be >= 0")
        missing = [k for k in ("{a}", "{op}", "{b}") if k not in self.template]
        if missing:
            raise ValueError(f"template={self.template!r} must contain {missing}")
        if self.num_train + self.num_test > self.num_problems():
            raise ValueError(
                f"num_train + num_test = {self.num_train + self.num_test} exceeds the "
                f"{self.num_problems()} distinct problems with {self.min_digits}..{self.max_digits} digits "
                f"and operators {self.operators}; raise max_digits or add operators"
            )

    def operand_range(self) -> tuple[int, int]:
        low = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        return low, 10**self.max_digits - 1

    def num_problems(self) -> int:
        low, high = self.operand_range()
        n = high - low + 1
        unordered = n * (n + 1) // 2  # "-" with nonnegative: a >= b only
        return sum(unordered if op == "-" and self.nonnegative else n * n for op in set(self.operators))


def arithmetic_splits(config: ArithmeticTaskConfig) -> tuple[list[Row], list[Row]]:
    """``(train_rows, test_rows)``: distinct problems, the same for the same config."""
    rng = random.Random(config.seed)
    low, high = config.operand_range()
    seen: set[tuple[int, str, int]] = set()
    rows: list[Row] = []
    while len(rows) < config.num_train + config.num_test:
        op = rng.choice(config.operators)
        a, b = rng.randint(low, high), rng.randint(low, high)
        if op == "-" and config.nonnegative and a < b:
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        rows.append({
            "prompt": config.template.format(a=a, op=op, b=b),
            "ground_truth": str(_apply(op, a, b)),
            "data_source": config.data_source,
        })
    return rows[: config.num_train], rows[config.num_train :]


def write_arithmetic_splits(
    out_dir: str | os.PathLike[str],
    config: ArithmeticTaskConfig,
    *,
    fmt: Literal["parquet", "jsonl"] = "parquet",
) -> dict[str, Path]:
    """Write ``train.<fmt>`` and ``test.<fmt>`` to ``out_dir``; return ``{"train": path, "test": path}``."""
    train, test = arithmetic_splits(config)
    out = Path(out_dir)
    return {"train": write_rows(train, out / f"train.{fmt}"), "test": write_rows(test, out / f"test.{fmt}")}


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


