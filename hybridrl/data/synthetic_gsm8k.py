"""Synthetic grade-school word problems in GSM8K's own format, for the tiny real-task recipe and tests.

No dataset hub here: ``grpo_gsm8k_tiny`` needs GSM8K-shaped data it can make itself. Each row is what
``openai/gsm8k`` holds — ``{"question": str, "answer": str}`` where the answer is a worked solution with
calculator annotations (``<<3*4=12>>``) ending in ``#### <number>`` (thousands separated: ``#### 15,000``)
— drawn from a few one- and two-step templates, so ``hybridrl prepare gsm8k --from`` reads it exactly like
the real file. Questions are distinct; rows are deterministic in ``seed``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

Row = dict[str, str]

_NAMES = ("Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jamal", "Kim", "Luis")
_ITEMS = ("apples", "stickers", "cards", "shells", "stamps", "beads")


def _bags(rng: random.Random, n: str) -> tuple[str, str]:
    item, a, b, c = rng.choice(_ITEMS), rng.randint(2, 30), rng.randint(2, 9), rng.randint(2, 12)
    bc, t = b * c, a + b * c
    return (f"{n} has {a} {item}. {n} buys {b} bags with {c} {item} in each bag. How many {item} does {n} have now?",
            f"{n} buys {b}*{c}=<<{b}*{c}={bc}>>{bc} {item}.\n{n} now has {a}+{bc}=<<{a}+{bc}={t}>>{t} {item}.\n"
            f"#### {t}")


def _spend(rng: random.Random, n: str) -> tuple[str, str]:
    b, c = rng.randint(3, 40), rng.randint(3, 40)
    s = b + c
    a = s + rng.randint(1, 60)
    return (f"{n} had ${a}. {n} spent ${b} on a book and ${c} on lunch. How many dollars does {n} have left?",
            f"{n} spent {b}+{c}=<<{b}+{c}={s}>>{s} dollars.\n{n} has {a}-{s}=<<{a}-{s}={a - s}>>{a - s} dollars "
            f"left.\n#### {a - s}")


def _share(rng: random.Random, n: str) -> tuple[str, str]:
    k, q = rng.randint(2, 9), rng.randint(2, 15)
    t = k * q
    return (f"{n} baked {t} cookies and shared them equally among {k} friends. How many cookies did each friend get?",
            f"Each friend got {t}/{k}=<<{t}/{k}={q}>>{q} cookies.\n#### {q}")


def _sales(rng: random.Random, n: str) -> tuple[str, str]:
    a, p = rng.randint(5, 40), rng.randint(100, 900)
    t = a * p
    return (f"{n}'s shop sells {a} bikes for ${p} each. How much money does the shop make?",
            f"The shop makes {a}*{p}=<<{a}*{p}={t}>>{t} dollars.\n#### {t:,}")


def _pages(rng: random.Random, n: str) -> tuple[str, str]:
    a, d, b = rng.randint(5, 40), rng.randint(2, 7), rng.randint(1, 30)
    ad, t = a * d, a * d + b
    return (f"{n} reads {a} pages every day for {d} days and then {b} more pages. How many pages did {n} read "
            f"in total?",
            f"In {d} days {n} reads {a}*{d}=<<{a}*{d}={ad}>>{ad} pages.\nIn total {n} read {ad}+{b}=<<{ad}+{b}={t}>>"
            f"{t} pages.\n#### {t}")


_TEMPLATES: tuple[Callable[[random.Random, str], tuple[str, str]], ...] = (_bags, _spend, _share, _sales, _pages)


def gsm8k_like_rows(n: int, *, seed: int = 0) -> list[Row]:
    """``n`` synthetic GSM8K-format rows (distinct questions), the same for the same seed."""
    rng = random.Random(seed)
    rows: list[Row] = []
    seen: set[str] = set()
    while len(rows) < n:
        question, answer = rng.choice(_TEMPLATES)(rng, rng.choice(_NAMES))
        if question not in seen:
            seen.add(question)
            rows.append({"question": question, "answer": answer})
    return rows
