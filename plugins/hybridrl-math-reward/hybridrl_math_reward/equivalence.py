"""Is an answer equal to the ground truth? math-verify's ``parse`` + ``verify``, safe off the main thread.

Checker: math-verify (HuggingFace, the checker of open-r1 and lighteval), not a sympy-only comparison.
Both end in sympy, but math-verify owns the hard part in front of it: LaTeX normalization
(``\\dfrac``, ``\\left(``, ``\\text{}``, units, ``^\\circ``, ``\\%``, thousands separators),
sets/tuples/intervals/matrices, equations (``x=3`` against ``3``), numeric comparison after rounding
(``0.5`` = ``\\frac{1}{2}``), and text choices (``\\text{(B)}`` = ``B``). A sympy-only checker would
re-implement that normalization, which is where the disagreements with human graders come from.

Off the main thread: math-verify's default time limits use ``signal.alarm``, which works only in the
main thread; the trainer scores in a worker thread (or a worker process). So every call here passes
``parsing_timeout=None`` / ``timeout_seconds=None`` and keeps pathological answers out up front. A
signal could not stop the worst cases anyway: they are single big-integer operations in C
(``10^{10^{10}}``, ``(10^{10})!``) that hold the GIL until done, so no in-process timer gets a turn
(nor does the trainer's thread-mode ``reward.timeout_s``). The guards, each found by a hang:

- length: callers do not parse an answer longer than ``MathReward.Config.max_answer_chars``;
- nesting: text with more than ``MAX_NESTING`` brackets open at once is not parsed (latex2sympy's
  ANTLR parser slows down steeply with depth);
- size: :func:`tame` drops a parsed expression with a numeric exponent above ``MAX_EXPONENT``, a
  numeric factorial/binomial/gamma argument above ``MAX_FACTORIAL`` or a numeric part whose value has
  more than ``MAX_DIGITS`` digits (``((2^2)^2)^{...}``), all checked in floating point, innermost first.

An answer that is not parsed, or whose expression is dropped, can still match verbatim (math-verify
compares the strings). No per-sample time limit: it would need a process per call. Left unbounded:
sympy's ``simplify`` on a symbolic expression within those bounds (well under a second in the tests);
a reward that must be killable mid-call runs in worker processes (``reward.num_workers``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import sympy
from math_verify import parse, verify
from sympy.functions.combinatorial.factorials import (
    FallingFactorial,
    RisingFactorial,
    binomial,
    factorial,
    factorial2,
    subfactorial,
)
from sympy.matrices import MatrixBase

MAX_EXPONENT = 10_000  # |e| of a numeric power b^e; 2^{2023} passes, 10^{10^{10}} does not
MAX_FACTORIAL = 10_000  # |n| of a numeric n!, n!!, !n, binomial(n, k), gamma(n), rising/falling factorials
MAX_DIGITS = 100_000  # of any numeric subexpression's value: 10000! (35,660 digits) passes
_MAX_MAGNITUDE = sympy.Float(10) ** MAX_DIGITS
# brackets open at once; latex2sympy's ANTLR parser slows down steeply with depth (20 nested braces:
# 2 s on a fresh parser, minutes once earlier inputs have filled its shared prediction cache); real
# answers need 3 or 4
MAX_NESTING = 8
_OPEN, _CLOSE = frozenset("([{"), frozenset(")]}")
_COMBINATORIAL = (factorial, factorial2, subfactorial, binomial, RisingFactorial, FallingFactorial, sympy.gamma)
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")

Parsed = list[Any]  # math-verify's parse result: sympy objects, then the matched string


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns once per process that its timeout is off; here that is deliberate (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


def parse_math(answer: str) -> Parsed:
    """One answer written as math (a ``\\boxed{}`` content, a ground truth), read as inline LaTeX.

    Newlines become spaces and unescaped ``$`` are dropped so the whole answer is one ``$...$``
    (``\\boxed{...}`` would be the obvious wrapper, but math-verify 0.9 cannot parse ``\\boxed{50\\%}``).
    """
    if nesting(answer) > MAX_NESTING:
        return []
    inline = _UNESCAPED_DOLLAR.sub("", answer.replace("\n", " "))
    return tame(parse(f"${inline}$", parsing_timeout=None))


def parse_text(text: str) -> Parsed:
    """math-verify's own extraction from free text (LaTeX environments, "the answer is ...", numbers)."""
    if nesting(text) > MAX_NESTING:
        return []
    return tame(parse(text, parsing_timeout=None))


def nesting(text: str) -> int:
    """The most brackets open at once in any part of ``text`` (a stray closer resets the count)."""
    depth = deepest = 0
    for char in text:
        if char in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif char in _CLOSE:
            depth = max(depth - 1, 0)
    return deepest


def equivalent(truth: Parsed, answer: Parsed) -> bool:
    """math-verify's ``verify(gold=truth, target=answer)``; it is not symmetric (``x=3`` vs ``3``)."""
    return bool(verify(truth, answer, timeout_seconds=None))


def tame(parsed: Parsed) -> Parsed:
    """``parsed`` without the expressions that sympy could take unbounded time to evaluate."""
    return [x for x in parsed if isinstance(x, str) or _is_tame(x)]


def _is_tame(expr: Any) -> bool:
    try:
        return _tame_node(expr)
    except RecursionError:  # a deeply nested expression: not worth the risk
        return False


def _tame_node(node: Any) -> bool:
    if isinstance(node, MatrixBase):
        return all(_tame_node(x) for x in node)
    if not isinstance(node, sympy.Basic):
        return True
    if not all(_tame_node(arg) for arg in node.args):  # children first: evaluating them below is then cheap
        return False
    if isinstance(node, _COMBINATORIAL) and not all(_at_most(arg, MAX_FACTORIAL) for arg in node.args if arg.is_number):
        return False
    if isinstance(node, sympy.Pow) and node.exp.is_number and not _at_most(node.exp, MAX_EXPONENT):
        return False
    if node.is_number and not node.is_Atom:  # ((2^2)^2)^...: each exponent is small, the value is not
        return _at_most(node, _MAX_MAGNITUDE)
    return True


def _at_most(number: sympy.Basic, limit: float | sympy.Float) -> bool:
    """``|number| <= limit``, evaluated in floating point; an infinity passes (sympy compares those cheaply),
    an error fails."""
    try:
        value = number.evalf(8)
        return value.is_finite is not True or bool(abs(value) <= limit)
    except Exception:  # sympy raises many types on odd input (TypeError, OverflowError, ...)
        return False
