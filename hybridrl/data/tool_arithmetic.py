"""The tool-use task of ``grpo_tool_tiny``: 2-digit products, which the tiny model cannot compute in its head, with the
``calculator`` tool; and the warm start's transcripts, which never show a product of two 2-digit numbers.

RL rows (:func:`product_splits`): ``prompt`` "37*58=", ``ground_truth`` "2146" (operands 10–99).
SFT rows (:func:`tool_sft_splits`): 1–2 digit sums and differences (:data:`TOOL_SFT`) and products with a 1-digit
operand and a 1–3 digit one (:func:`small_products`: "7*583=", "46*3=", a third of the rows), each answered half
directly ("46") and half through the calculator, as the multi-turn rollout lays the conversation out under ChatML:
the call, the end of the turn, the tool's reply, and the answer::

    <tool_call>{"name":"calculator","arguments":{"expression":"12+34"}}</tool_call><|im_end|>
    <|im_start|>tool
    46<|im_end|>
    <|im_start|>assistant
    46

Why not addition alone, as the issue asked: the warm start then writes the operator it saw, not the question's.
Measured where the call's operator goes, for 2-digit product questions: with sums alone P("*") < 1e-4 (it writes
"+"); with sums and differences P("*") ≤ 1e-4 still ("*" never seen: its embedding untrained); with 1-digit products
added P("*") ≈ 1e-3 (it wrote "*" for 1-digit operands only: operand size, not the question's operator, was its
cue). So the warm start shows calls with all three operators, but never a product of two 2-digit numbers, and
answers half its questions without the tool — for such a product always wrongly. Its products' other operand has up
to 3 digits, so it has seen 4-digit replies to copy: with products of a 1-digit and a 1–2 digit operand only (every
reply ≤ 3 digits), it called the tool right on 2-digit products but dropped a digit copying the 4-digit reply
("1562" → "152"), and RL stalled at 0.22 held-out accuracy. With 1–3 digit operands: greedy held-out accuracy 0.73
at the start (sampled, most answers come without the tool: reward 0.34), 0.995 after 10 RL steps. Calling the tool
on every sampled 2-digit product is what RL learns. Sums of up to 3 digits instead made it write "8*73" for 82*73
(0.005). The warm start (plain SFT on this text) also trains on the tool's reply; RL trains only on what the policy
samples.
"""

from __future__ import annotations

import json
import random

from hybridrl.data.arithmetic import ArithmeticTaskConfig, arithmetic_splits
from hybridrl.data.rows import Row

TOOL_SFT = dict(min_digits=1, max_digits=2, operators=["+", "-"], num_train=4000, num_test=200, seed=0)
SMALL_PRODUCTS = dict(num_train=2000, num_test=60, seed=0)  # a*b, one operand 0–9, the other 0–999
PRODUCTS = dict(min_digits=2, max_digits=2, operators=["*"], num_train=3000, num_test=200, seed=1,
                data_source="products")


def product_splits() -> tuple[list[Row], list[Row]]:
    return arithmetic_splits(ArithmeticTaskConfig(**PRODUCTS))  # type: ignore[arg-type]


def small_products() -> tuple[list[Row], list[Row]]:
    """Train and test rows of ``a*b`` and ``b*a`` with a in 0–9 and b in 0–999 (never two 2-digit operands)."""
    pairs = [(a, b) for a in range(10) for b in range(1000)] + [(b, a) for a in range(10) for b in range(1000)]
    random.Random(int(SMALL_PRODUCTS["seed"])).shuffle(pairs)
    rows = [{"prompt": f"{a}*{b}=", "ground_truth": str(a * b), "data_source": "arithmetic"} for a, b in pairs]
    n, m = int(SMALL_PRODUCTS["num_train"]), int(SMALL_PRODUCTS["num_test"])
    return rows[:n], rows[n:n + m]


def tool_sft_splits() -> list[list[Row]]:
    """The warm start's train and test transcripts: :data:`TOOL_SFT` and :func:`small_products`, shuffled."""
    sums = arithmetic_splits(ArithmeticTaskConfig(**TOOL_SFT))  # type: ignore[arg-type]
    out = []
    for i, (a, b) in enumerate(zip(sums, small_products(), strict=True)):
        rows = a + b
        random.Random(i).shuffle(rows)
        out.append(tool_sft_rows(rows, seed=i))
    return out


def tool_call_text(expression: str) -> str:
    """A ``calculator`` call in the Hermes format (``multi_turn.format=hermes``), JSON without spaces."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def tool_sft_rows(rows: list[Row], *, seed: int, tool_share: float = 0.5) -> list[Row]:
    """``rows`` (``prompt`` "a+b=", ``ground_truth``) as SFT pairs: ``tool_share`` of them through the calculator."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        answer = str(row["ground_truth"])
        if rng.random() < tool_share:
            expression = str(row["prompt"]).rstrip("=")
            answer = (f"{tool_call_text(expression)}<|im_end|>\n<|im_start|>tool\n{answer}<|im_end|>\n"
                      f"<|im_start|>assistant\n{answer}")
        out.append({**row, "ground_truth": answer})
    return out
