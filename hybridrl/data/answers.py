"""Final answers of math tasks, as the datasets write them (public API: data preparation and reward plugins).

- GSM8K: the solution ends with ``#### <answer>``; the answer is the text after the last ``####`` with
  thousands separators dropped (``#### 1,000`` → ``1000``).
- MATH (Hendrycks et al. 2021): the answer is the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``)
  of the solution, braces matched (``\\boxed{\\frac{1}{2}}`` → ``\\frac{1}{2}``); ``\\boxed 5`` (no braces)
  is accepted too.
"""

from __future__ import annotations

import re

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")


def gsm8k_answer(text: str) -> str | None:
    """The answer after the last ``####`` of ``text`` (commas and ``$`` removed), or None."""
    _, sep, tail = text.rpartition("####")
    if not sep:
        return None
    answer = tail.strip().splitlines()[0].strip() if tail.strip() else ""
    answer = answer.replace(",", "").replace("$", "").strip()
    return answer or None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` (braces matched), or None.

    Linear in the text (one pass pairs every brace), so a model looping on unclosed ``\\boxed{`` costs
    no more than reading its response."""
    closing: dict[int, int] = {}  # "{" position -> its "}"
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    for m in reversed(list(_BOX.finditer(text))):
        start = m.end()
        if start < len(text) and text[start] == "{":
            if start in closing:
                return text[start + 1:closing[start]].strip()
            continue  # unbalanced: try an earlier one
        word = re.match(r"([^\s$]+)", text[start:])  # "\boxed 5"
        if word:
            return word.group(1)
    return None
