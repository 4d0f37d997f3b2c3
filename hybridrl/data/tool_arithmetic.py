"""The tool-use task of ``grpo_tool_tiny``: 2-digit products, which the tiny model cannot compute in its head, with the
``calculator`` tool; and the warm start's transcripts, which show the call format on sums and differences only.

RL rows (:func:`product_splits`): ``prompt`` "37*58=", ``ground_truth`` "2146" (operands 10–99).
SFT rows (:func:`tool_sft_rows`, :data:`TOOL_SFT`): 1–2 digit sums and differences, answered half directly ("46")
and half through the calculator, as the multi-turn rollout lays the conversation out under ChatML: the call, the end
of the turn, the tool's reply, and the answer::

    <tool_call>{"name":"calculator","arguments":{"expression":"12+34"}}</tool_call><|im_end|>
    <|im_start|>tool
    46<|im_end|>
    <|im_start|>assistant
    46

Why differences too, when the issue asked for addition only: with one operator the operator is a constant of the
call, and the warm start writes "+" whatever the question says (measured: P("*") < 1e-4 where the call's operator
goes, for product questions); with two, the call copies the question's expression. No product is ever shown, and
half the answers skip the tool, so calling it for products is what RL learns. The warm start (plain SFT on this
text) also trains on the tool's reply; RL trains only on what the policy samples.
"""

from __future__ import annotations

import json
import random

from hybridrl.data.arithmetic import ArithmeticTaskConfig, arithmetic_splits
from hybridrl.data.rows import Row

TOOL_SFT = dict(min_digits=1, max_digits=2, operators=["+", "-"], num_train=4000, num_test=200, seed=0)
PRODUCTS = dict(min_digits=2, max_digits=2, operators=["*"], num_train=3000, num_test=200, seed=1,
                data_source="products")


def product_splits() -> tuple[list[Row], list[Row]]:
    return arithmetic_splits(ArithmeticTaskConfig(**PRODUCTS))  # type: ignore[arg-type]


def tool_sft_splits() -> list[list[Row]]:
    """The warm start's train and test transcripts (:data:`TOOL_SFT`)."""
    splits = arithmetic_splits(ArithmeticTaskConfig(**TOOL_SFT))  # type: ignore[arg-type]
    return [tool_sft_rows(rows, seed=i) for i, rows in enumerate(splits)]


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
