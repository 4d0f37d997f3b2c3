"""The synthetic arithmetic task: seeded, disjoint splits, correct answers, parquet/jsonl output."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridrl.data.arithmetic import ArithmeticTaskConfig, arithmetic_splits, write_arithmetic_splits
from hybridrl.data.rows import read_rows

PATTERN = re.compile(r"^(\d+)([-+*])(\d+)=$")


def test_splits_are_seeded_disjoint_and_correct() -> None:
    cfg = ArithmeticTaskConfig(min_digits=2, max_digits=3, operators=["+", "-", "*"], num_train=300,
                               num_test=50, seed=4)
    train, test = arithmetic_splits(cfg)
    assert (len(train), len(test)) == (300, 50)
    assert arithmetic_splits(cfg) == (train, test)
    assert arithmetic_splits(ArithmeticTaskConfig(num_train=300, num_test=50, seed=5))[0] != train
    prompts = [r["prompt"] for r in train + test]
    assert len(set(prompts)) == len(prompts)
    seen_ops = set()
    for row in train + test:
        match = PATTERN.match(row["prompt"])
        assert match, row
        a, op, b = int(match[1]), match[2], int(match[3])
        assert 10 <= a <= 999 and 10 <= b <= 999
        assert row["ground_truth"] == str({"+": a + b, "-": a - b, "*": a * b}[op])
        assert op != "-" or a >= b  # nonnegative
        seen_ops.add(op)
    assert seen_ops == {"+", "-", "*"}


def test_template_and_negative_answers() -> None:
    cfg = ArithmeticTaskConfig(operators=["-"], nonnegative=False, num_train=200, num_test=0,
                               template="What is {a} {op} {b}?")
    train, _ = arithmetic_splits(cfg)
    assert all(r["prompt"].startswith("What is ") for r in train)
    assert any(r["ground_truth"].startswith("-") for r in train)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_written_files_read_back(tmp_path: Path, fmt: str) -> None:
    cfg = ArithmeticTaskConfig(num_train=20, num_test=5)
    paths = write_arithmetic_splits(tmp_path, cfg, fmt=fmt)  # type: ignore[arg-type]
    assert paths["train"].name == f"train.{fmt}"
    train, test = arithmetic_splits(cfg)
    assert [r for _, r in read_rows(paths["train"])] == train
    assert [r for _, r in read_rows(paths["test"])] == test
    assert set(train[0]) == {"prompt", "ground_truth", "data_source"}


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="exceeds the 100 distinct problems"):
        ArithmeticTaskConfig(max_digits=1, num_train=90, num_test=20)
    assert ArithmeticTaskConfig(max_digits=1, operators=["-"], num_train=55, num_test=0).num_problems() == 55
    with pytest.raises(ValueError, match=r"operators=\['/'\]"):
        ArithmeticTaskConfig(operators=["/"])
    with pytest.raises(ValueError, match=r"template='\{a\}\+\{b\}' must contain \['\{op\}'\]"):
        ArithmeticTaskConfig(template="{a}+{b}")
    with pytest.raises(ValueError, match="min_digits=3, max_digits=2"):
        ArithmeticTaskConfig(min_digits=3)
