"""The tool-use task of ``grpo_tool_tiny``: 2-digit products, which the tiny model cannot compute in its head, with the
``calculator`` tool; and the warm start's transcripts, which never show a 2-digit product.

RL rows (:func:`product_splits`): ``prompt`` "37*58=", ``ground_truth`` "2146" (operands 10–99).
SFT rows (:func:`tool_sft_splits`): 1–2 digit sums and differences (:data:`TOOL_SFT`) and 1-digit products
(:data:`SMALL_PRODUCTS`, repeated to a tenth of the rows), each answered half directly ("46") and half through the
calculator, as the multi-turn rollout lays the conversation out under ChatML: the call, the end of the turn, the
tool's reply, and the answer::

    <tool_call>{"name":"calculator","arguments":{"expression":"12+34"}}</tool_call><|im_end|>
    <|im_start|>tool
    46<|im_end|>
    <|im_start|>assistant
    46

Why not addition alone, as the issue asked: the warm start then writes the operator it saw, not the question's.
Measured where the call's operator goes, for product questions: with sums alone P("*") < 1e-4 (it writes "+"); with
sums and differences P("*") ≤ 1e-4 still ("*" never seen, its embedding untrained: nothing to copy). So the warm
start shows calls with all three operators, but products only of one digit, which the model can learn by heart; it
never sees a 2-digit product, and answers half its questions without the tool — for a 2-digit product always
wrongly. Calling the tool on every 2-digit product, and copying its reply, is what RL learns. The warm start (plain
SFT on this text) also trains on the tool's reply; RL trains only on what the policy samples.
"""

from __future__ import annotations

import json
import random

from hybridrl.data.arithmetic import ArithmeticTaskConfig, arithmetic_splits
from hybridrl.data.rows import Row

TOOL_SFT = dict(min_digits=1, max_digits=2, operators=["+", "-"], num_train=4000, num_test=200, seed=0)
SMALL_PRODUCTS = dict(min_digits=1, max_digits=1, operators=["*"], num_train=90, num_test=10, seed=0)
PRODUCTS = dict(min_digits=2, max_digits=2, operators=["*"], num_train=3000, num_test=200, seed=1,
                data_source="products")


def product_splits() -> tuple[list[Row], list[Row]]:
    return arithmetic_splits(ArithmeticTaskConfig(**PRODUCTS))  # type: ignore[arg-type]


def tool_sft_splits() -> list[list[Row]]:
    """The warm start's train and test transcripts: :data:`TOOL_SFT` and :data:`SMALL_PRODUCTS` (the products'
    train rows repeated to about a tenth of the train split), shuffled."""
    sums = arithmetic_splits(ArithmeticTaskConfig(**TOOL_SFT))  # type: ignore[arg-type]
    products = arithmetic_splits(ArithmeticTaskConfig(**SMALL_PRODUCTS))  # type: ignore[arg-type]
    repeat = max(1, len(sums[0]) // (9 * len(products[0])))
    out = []
    for i, (a, b) in enumerate(zip(sums, (products[0] * repeat, products[1]), strict=True)):
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
