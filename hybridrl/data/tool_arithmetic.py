"""The tool-use task of ``grpo_tool_tiny``: 2-digit products, which the tiny model cannot compute in its head, with the
``calculator`` tool; and the warm start's transcripts, which never show a 2-digit product.

RL rows (:func:`product_splits`): ``prompt`` "37*58=", ``ground_truth`` "2146" (operands 10–99).
SFT rows (:func:`tool_sft_splits`): 1–2 digit sums and differences (:data:`TOOL_SFT`) and products with a 1-digit
operand (:func:`small_products`: "7*58=", "6*3=", a quarter of the rows), each answered half directly ("46") and half
through the calculator, as the multi-turn rollout lays the conversation out under ChatML: the call, the end of the
turn, the tool's reply, and the answer::

    <tool_call>{"name":"calculator","arguments":{"expression":"12+34"}}</tool_call><|im_end|>
    <|im_start|>tool
    46<|im_end|>
    <|im_start|>assistant
    46

Why not addition alone, as the issue asked: the warm start then writes the operator it saw, not the question's.
Measured where the call's operator goes, for 2-digit product questions: with sums alone P("*") < 1e-4 (it writes
"+"); with sums and differences P("*") ≤ 1e-4 still ("*" never seen: its embedding untrained); with 1-digit products
added P("*") ≈ 1e-3 (it wrote "*" for 1-digit operands only: operand size, not the question's operator, was its
cue). So the warm start shows calls with all three operators at every operand size except two 2-digit ones: it never
sees a product of two 2-digit numbers, and answers half its questions without the tool — for such a product always
wrongly. Calling the tool on every 2-digit product is what RL learns, and copying a 4-digit reply, which it has never
seen (every reply it saw has at most 3 digits). Sums of up to 3 digits, to show 4-digit replies, made it worse: it
then wrote "8*73" for 82*73, a product always having had a 1-digit operand (held-out accuracy 0.005, no reward in
5 steps). The warm start (plain SFT on this text) also trains on the tool's reply; RL trains only on what the policy
samples.
"""

from __future__ import annotations

import json
import random

from hybridrl.data.arithmetic import ArithmeticTaskConfig, arithmetic_splits
from hybridrl.data.rows import Row

TOOL_SFT = dict(min_digits=1, max_digits=2, operators=["+", "-"], num_train=4000, num_test=200, seed=0)
SMALL_PRODUCTS = dict(num_train=1400, num_test=40, seed=0)  # products with a 1-digit operand (of 1900)
PRODUCTS = dict(min_digits=2, max_digits=2, operators=["*"], num_train=3000, num_test=200, seed=1,
                data_source="products")


def product_splits() -> tuple[list[Row], list[Row]]:
    return arithmetic_splits(ArithmeticTaskConfig(**PRODUCTS))  # type: ignore[arg-type]


def small_products() -> tuple[list[Row], list[Row]]:
    """Train and test rows of ``a*b`` with a or b < 10 (operands 0–99, never both of two digits)."""
    pairs = [(a, b) for a in range(100) for b in range(100) if min(a, b) < 10]
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
