"""Small source files in each dataset's own format, written by the project itself (no download).

Import from other tests as ``from data.fixtures import write_gsm8k_source`` (``tests/`` is on sys.path).

- GSM8K (openai/gsm8k): ``{"question", "answer"}``, the answer a worked solution with calculator
  annotations (``<<3*4=12>>``) ending in ``#### N`` (``#### 1,248``: thousands separators).
  :data:`GSM8K_ROWS` are 12 hand-written rows; :func:`gsm8k_rows` draws any number of synthetic
  grade-school word problems from templates with a seed (answers are computed, so always correct).
- MATH (Hendrycks): ``{"problem", "level", "type", "solution"}``, the answer the last ``\\boxed{}``;
  MATH-500: ``{"problem", "solution", "answer", "subject", "level", "unique_id"}``.
- A generic jsonl: ``{"question", "answer", "id", "topic"}``.
- :func:`write_hf_dataset`: a local ``datasets`` directory (``data/<split>-00000-of-00001.parquet``);
  :func:`offline_datasets` keeps ``datasets`` off the network and its cache out of the home directory.

Prompts are printable ASCII, so the char tokenizer of the tiny models keeps every character.
Each ``*_ANSWERS`` list holds the ground truth that preparation must extract, row by row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from hybridrl.data.rows import Row, write_rows
from hybridrl.data.synthetic_gsm8k import gsm8k_like_rows

GSM8K_ROWS: list[Row] = [
    {"question": "Maya buys 3 packs of pencils with 4 pencils in each pack. She gives 5 pencils to her brother. "
                 "How many pencils does she have left?",
     "answer": "Maya buys 3*4=<<3*4=12>>12 pencils.\nShe has 12-5=<<12-5=7>>7 pencils left.\n#### 7"},
    {"question": "A school bus holds 48 students. How many students can 26 buses hold in total?",
     "answer": "26 buses hold 26*48=<<26*48=1248>>1248 students.\n#### 1,248"},
    {"question": "Tom earns $15 an hour. He works 8 hours a day for 5 days. How much money does he earn?",
     "answer": "In one day he earns 15*8=<<15*8=120>>120 dollars.\nIn 5 days he earns 120*5=<<120*5=600>>600 "
               "dollars.\n#### 600"},
    {"question": "A baker makes 120 muffins and sells 3/4 of them. How many muffins are left?",
     "answer": "He sells 120*3/4=<<120*3/4=90>>90 muffins.\nSo 120-90=<<120-90=30>>30 muffins are left.\n#### 30"},
    {"question": "Lena runs 2.5 miles every morning. How many miles does she run in 6 mornings?",
     "answer": "She runs 2.5*6=<<2.5*6=15>>15 miles.\n#### 15"},
    {"question": "A farmer has 17 cows and 3 times as many chickens. How many animals does he have?",
     "answer": "He has 17*3=<<17*3=51>>51 chickens.\nHe has 17+51=<<17+51=68>>68 animals.\n#### 68"},
    {"question": "A concert hall has 35 rows of 42 seats. 289 seats are empty. How many people are seated?",
     "answer": "The hall has 35*42=<<35*42=1470>>1470 seats.\nSo 1470-289=<<1470-289=1181>>1181 people are "
               "seated.\n#### 1,181"},
    {"question": "Sam splits 64 marbles equally into 8 bags and then loses one bag. How many marbles does he "
                 "still have?",
     "answer": "Each bag holds 64/8=<<64/8=8>>8 marbles.\nHe still has 64-8=<<64-8=56>>56 marbles.\n#### 56"},
    {"question": "A movie ticket costs $12 and popcorn costs $7. How much do 4 friends pay if each buys a ticket "
                 "and popcorn?",
     "answer": "Each friend pays 12+7=<<12+7=19>>19 dollars.\nTogether they pay 19*4=<<19*4=76>>76 dollars.\n#### 76"},
    {"question": "Priya's garden has 9 rows of 14 tulips. She picks 25 tulips. How many tulips are left?",
     "answer": "The garden has 9*14=<<9*14=126>>126 tulips.\n126-25=<<126-25=101>>101 tulips are left.\n#### 101"},
    {"question": "A company pays $1,250 rent per month. How much rent does it pay in a year?",
     "answer": "It pays 1250*12=<<1250*12=15000>>15000 dollars a year.\n#### 15,000"},
    {"question": "It was 8 degrees in the morning, and the temperature dropped 11 degrees by night. What was the "
                 "temperature at night?",
     "answer": "At night it was 8-11=<<8-11=-3>>-3 degrees.\n#### -3"},
]
GSM8K_ANSWERS = ["7", "1248", "600", "30", "15", "68", "1181", "56", "76", "101", "15000", "-3"]

MATH_ROWS: list[Row] = [
    {"problem": "Solve for $x$: $2x = 1$.", "level": "Level 1", "type": "Algebra",
     "solution": "Dividing both sides by 2 gives $x = \\boxed{\\frac{1}{2}}$."},
    {"problem": "Compute $\\sqrt{2} + \\frac{3}{4}$ in simplest form.", "level": "Level 2", "type": "Algebra",
     "solution": "Nothing simplifies, so the answer is $\\boxed{\\sqrt{2}+\\frac{3}{4}}$."},
    {"problem": "What is $2 + 3$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "We have $2 + 3 = 5$, so the answer is $\\boxed 5$."},
    {"problem": "How many positive divisors does $64$ have?", "level": "Level 2", "type": "Number Theory",
     "solution": "Since $64 = 2^6$, it has $6 + 1 = \\fbox{7}$ positive divisors."},
    {"problem": "Which of the graphs (A), (B), (C) is the graph of $y = x^2$?", "level": "Level 3",
     "type": "Intermediate Algebra", "solution": "Only (B) is a parabola, so the answer is $\\boxed{\\text{(B)}}$."},
    {"problem": "What is $2 + 2$?", "level": "Level 1", "type": "Prealgebra",
     "solution": "A first guess of $\\boxed{3}$ is wrong; counting again gives $\\boxed{4}$."},
    {"problem": "Solve $x - 2 \\le 0$. Give your answer in interval notation.", "level": "Level 2",
     "type": "Algebra", "solution": "We get $x \\le 2$, that is $x \\in \\boxed{(-\\infty, 2]}$."},
    {"problem": "Expand $(x + 1)^2$.", "level": "Level 1", "type": "Algebra",
     "solution": "$(x+1)^2 = \\boxed{x^2+2x+1}$."},
    {"problem": "What is $\\arctan 1$?", "level": "Level 1", "type": "Precalculus",
     "solution": "Since $\\tan \\frac{\\pi}{4} = 1$, $\\arctan 1 = \\boxed{\\dfrac{\\pi}{4}}$."},
    {"problem": "Find the vector $\\mathbf{v}$ with $\\mathbf{v} - \\mathbf{e}_1 = \\mathbf{e}_2 + \\mathbf{e}_1$.",
     "level": "Level 2", "type": "Precalculus",
     "solution": "Hence $\\mathbf{v} = \\boxed{\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}}$."},
    {"problem": "A price rises from $100$ to $110$ dollars. By what percent did it rise?", "level": "Level 2",
     "type": "Prealgebra", "solution": "It rose by $10$ dollars out of $100$, which is $\\boxed{10\\%}$."},
    {"problem": "Find all roots of $x^2 + x - 6 = 0$, separated by commas.", "level": "Level 3", "type": "Algebra",
     "solution": "Factoring, $(x - 2)(x + 3) = 0$, so the roots are $\\boxed{2, -3}$."},
]
MATH_ANSWERS = ["\\frac{1}{2}", "\\sqrt{2}+\\frac{3}{4}", "5", "7", "\\text{(B)}", "4", "(-\\infty, 2]",
                "x^2+2x+1", "\\dfrac{\\pi}{4}", "\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}", "10\\%", "2, -3"]

MATH500_ROWS: list[Row] = [  # the answer column is the ground truth, even where the solution boxes it differently
    {"problem": "What is $3 \\cdot 4$?", "solution": "$3 \\cdot 4 = \\boxed{12}$.", "answer": "12",
     "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/1.json"},
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "$\\frac{2}{4} = \\boxed{0.5}$.", "answer": "\\frac{1}{2}",
     "subject": "Prealgebra", "level": 1, "unique_id": "test/prealgebra/2.json"},
    {"problem": "Solve $x^2 = 9$ for $x > 0$.", "solution": "So $x = \\boxed{3}$.", "answer": "3",
     "subject": "Algebra", "level": 2, "unique_id": "test/algebra/3.json"},
]
MATH500_ANSWERS = ["12", "\\frac{1}{2}", "3"]

GENERIC_ROWS: list[Row] = [
    {"question": f"What is {a} times {b}?", "answer": a * b, "id": i, "topic": "multiplication"}
    for i, (a, b) in enumerate([(7, 6), (3, 9), (12, 12), (5, 0), (8, 7), (11, 4)])
]
GENERIC_ANSWERS = [str(r["answer"]) for r in GENERIC_ROWS]

def gsm8k_rows(n: int, *, seed: int = 0) -> list[Row]:
    """``n`` synthetic GSM8K-format rows (:mod:`hybridrl.data.synthetic_gsm8k`, the tiny recipe's generator)."""
    return gsm8k_like_rows(n, seed=seed)


def write_gsm8k_source(path: str | Path, *, n: int | None = None, seed: int = 0) -> Path:
    """GSM8K-format rows at ``path`` (.jsonl or .parquet): :data:`GSM8K_ROWS`, or ``n`` synthetic ones."""
    return write_rows(GSM8K_ROWS if n is None else gsm8k_rows(n, seed=seed), path)


def write_math_source(path: str | Path) -> Path:
    """:data:`MATH_ROWS` (Hendrycks MATH layout) at ``path``."""
    return write_rows(MATH_ROWS, path)


def write_math500_source(path: str | Path) -> Path:
    """:data:`MATH500_ROWS` (MATH-500 layout, with an answer column) at ``path``."""
    return write_rows(MATH500_ROWS, path)


def write_generic_source(path: str | Path, *, question_key: str = "question", answer_key: str = "answer") -> Path:
    """:data:`GENERIC_ROWS` at ``path``, with their question/answer columns renamed."""
    names = {"question": question_key, "answer": answer_key}
    return write_rows([{names.get(k, k): v for k, v in r.items()} for r in GENERIC_ROWS], path)


def write_hf_dataset(directory: str | Path, splits: Mapping[str, Sequence[Row]]) -> Path:
    """A local ``datasets`` directory (``data/<split>-00000-of-00001.parquet``): ``load_dataset(directory,
    split=...)`` reads it offline."""
    directory = Path(directory)
    for split, rows in splits.items():
        write_rows(list(rows), directory / "data" / f"{split}-00000-of-00001.parquet")
    return directory


def offline_datasets(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    """``datasets`` in offline mode (a hub name fails at once, as without network), caching under ``cache_dir``."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache_dir)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
