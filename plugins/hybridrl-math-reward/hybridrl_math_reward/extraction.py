"""The final answer in a response's text, by task format (``MathReward.Config.extract``).

- ``gsm8k``: the text after the last ``####`` (``hybridrl.data.answers.gsm8k_answer``: commas and ``$``
  dropped); without one, the last number of the text (a fallback, not the format).
- ``boxed`` (MATH): the content of the last ``\\boxed{...}`` (``hybridrl.data.answers.last_boxed``);
  without one, what math-verify's own extraction finds in the last ``max_chars`` characters
  ("the final answer is $...$", the last LaTeX environment or number; a fallback, not the format).
- ``last_number``: the last number of the text (``-1,234.5`` → ``-1234.5``); that is the format.

An answer found by the format is ``formatted``; one found by a fallback is not. An answer longer than
``max_chars`` is kept (it is an answer) but not parsed: it can only match the ground truth verbatim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from hybridrl.data.answers import gsm8k_answer, last_boxed
from hybridrl_math_reward.equivalence import Parsed, parse_math, parse_text

Format = Literal["gsm8k", "boxed", "last_number"]
FORMATS: tuple[Format, ...] = ("gsm8k", "boxed", "last_number")
# thousands-grouped first ("1,234.5"), then plain ("1234.5", "-7"), then a bare decimal (".5")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    text: str  # as extracted (info["extracted"])
    parsed: Parsed  # math-verify's reading of it; [] when too long or unreadable
    formatted: bool  # found by the format itself, not by a fallback


def last_number(text: str) -> str | None:
    """The last number of ``text`` without thousands separators, or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_answer(text: str, fmt: Format, *, max_chars: int) -> Answer | None:
    """The answer of ``text`` in format ``fmt`` (see the module docstring), or None."""
    if fmt == "boxed":
        boxed = last_boxed(text)
        if boxed:
            return _answer(boxed, formatted=True, max_chars=max_chars, as_math=True)
        found = parse_text(text[-max_chars:])
        if not found:
            return None
        written = next((x for x in found if isinstance(x, str)), str(found[0]))
        return Answer(text=written, parsed=found, formatted=False)
    if fmt == "gsm8k":
        marked = gsm8k_answer(text)
        if marked is not None:
            return _answer(marked, formatted=True, max_chars=max_chars, as_math=False)
    number = last_number(text)
    if number is None:
        return None
    return _answer(number, formatted=fmt == "last_number", max_chars=max_chars, as_math=False)


def _answer(text: str, *, formatted: bool, max_chars: int, as_math: bool) -> Answer:
    """``as_math``: the text is math throughout (a box's content); else prose that holds it ("18 dollars")."""
    if len(text) > max_chars:
        return Answer(text=text, parsed=[], formatted=formatted)
    return Answer(text=text, parsed=parse_math(text) if as_math else parse_text(text), formatted=formatted)
