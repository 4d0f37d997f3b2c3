"""``gsm8k``: the policy submits its answer to a GSM8K problem and is told whether it is right (verl's
``verl.tools.gsm8k_tool.Gsm8kTool``, whose examples/sglang_multiturn scripts call it ``calc_gsm8k_reward``).

The tool takes its sample (``takes_sample``, :class:`~hybridrl.interfaces.ToolSample`): the ground truth is the row's
``extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth``, as verl's gsm8k preprocessing
(examples/data_preprocess/gsm8k_multiturn_w_tool.py) writes it, else the row's own (``data.ground_truth_key``); a
row with neither is an error observation naming both.

The answer is the last number of what the policy submitted (thousands separators and ``$`` dropped), as verl's
"flexible" GSM8K parse takes it; the reply reads as verl's does, ``Current parsed answer='72' reward=1.0`` (0.0 for
a wrong or unparsable answer). Deviation: the numbers are compared by value (``72.0`` is ``72``), where verl
compares the strings.

The reply only: the tool's reward does not count in the sample's score. verl's tool returns a step reward as well
(0.0, or -0.05 for an answer no better than the episode's last) that its agent loop only records
(``tool_rewards``); the score verl trains on is its reward function's, and here it is ``reward.name``'s (``math``
scores the final answer against the same ground truth). Each call is answered on its own: there is no state
across an episode's calls (verl's current agent loop creates and releases the tool at every call too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar

from hybridrl.data.answers import gsm8k_answer
from hybridrl.interfaces import ToolSample

NAME = "calc_gsm8k_reward"  # the function the policy calls: the key of verl's rows' tools_kwargs
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class Gsm8kTool:
    """``gsm8k`` tool: ``{"answer": "72"}`` → ``"Current parsed answer='72' reward=1.0"`` for a sample whose ground
    truth is 72."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        pass

    takes_sample: ClassVar[bool] = True
    schema: ClassVar[dict[str, Any]] = {"type": "function", "function": {
        "name": NAME,
        "description": "Submit your final answer to the math problem; the reply says whether it is correct "
                       "(reward 1.0) or not (reward 0.0).",
        "parameters": {"type": "object", "properties": {"answer": {
            "type": "string", "description": "the final answer, a number, e.g. 72"}}, "required": ["answer"]}}}

    def __init__(self, config: Gsm8kTool.Config | None = None, **ctx: Any) -> None:
        self.config = config if config is not None else self.Config()

    def __call__(self, arguments: dict[str, Any], *, sample: ToolSample) -> str:
        if "answer" not in arguments or set(arguments) - {"answer"}:
            raise ValueError(f"{NAME} takes {{\"answer\": \"<number>\"}}, got {arguments!r}")
        answer = str(arguments["answer"])
        truth = ground_truth(sample)
        right = (mine := number(answer)) is not None and mine == number(gsm8k_answer(truth) or truth)
        return f"Current parsed answer={answer!r} reward={float(right)}"


def ground_truth(sample: ToolSample) -> str:
    """The sample's ground truth: its create_kwargs' (verl's rows), else its row's."""
    truth = sample.create_kwargs.get("ground_truth")
    if truth is None:
        truth = sample.meta.ground_truth
    if truth is None:
        raise ValueError(f"this sample has no ground truth: neither extra_info.tools_kwargs.{NAME}.create_kwargs."
                         "ground_truth nor the column data.ground_truth_key names")
    return str(truth)


def number(text: str) -> Decimal | None:
    """The last number of ``text`` (``1,000`` is 1000; ``$`` ignored), or None where it has none."""
    found = _NUMBER.findall(text.replace("$", ""))
    if not found:
        return None
    try:
        return Decimal(found[-1].replace(",", ""))
    except InvalidOperation:
        return None
