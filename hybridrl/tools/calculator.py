"""``calculator``: integer arithmetic for the policy, parsed here (a recursive-descent parser; never ``eval``).

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "/" | "//" | "%") unary)*      "/" and "//": floor division, as Python's "//"
    unary  := ("+" | "-") unary | power
    power  := atom ("**" unary)?                           as Python: -2**2 = -4, 2**3**2 = 512
    atom   := INTEGER | "(" expr ")"

The exponent must lie in 0..MAX_EXPONENT.

Anything else (a float, a name, a call, an unbalanced parenthesis, division by zero, a result of more than
``max_digits`` digits) raises ``ValueError`` naming what and where; the multi-turn rollout turns it into an error
observation for the policy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

MAX_EXPONENT = 1024
_TOKEN = re.compile(r"\s*(?:(\d+)|(\*\*|//|[-+*/%()]))")


class Calculator:
    """``calculator`` tool: ``{"expression": "12*(3+4)"}`` → ``"84"``."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        max_digits: int = 1000  # a longer result is an error (keeps 9**9**9 from eating the step)
        max_length: int = 1000  # characters of an expression

        def __post_init__(self) -> None:
            if self.max_digits < 1 or self.max_length < 1:
                raise ValueError(f"max_digits={self.max_digits} and max_length={self.max_length} must be ≥ 1")

    schema: ClassVar[dict[str, Any]] = {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an integer arithmetic expression: + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {
            "type": "string", "description": "e.g. 12*(3+4)"}}, "required": ["expression"]}}}

    def __init__(self, config: Calculator.Config | None = None, **ctx: Any) -> None:
        self.config = config if config is not None else self.Config()

    def __call__(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str) or set(arguments) - {"expression"}:
            raise ValueError(f"calculator takes {{\"expression\": \"<integer arithmetic>\"}}, got {arguments!r}")
        if len(expression) > self.config.max_length:
            raise ValueError(f"expression of {len(expression)} characters; at most {self.config.max_length}")
        return str(evaluate(expression, max_digits=self.config.max_digits))


def evaluate(expression: str, *, max_digits: int = 1000) -> int:
    return _Parser(expression, max_digits=max_digits).parse()


class _Parser:
    def __init__(self, text: str, *, max_digits: int) -> None:
        self.text, self.max_digits = text, max_digits
        self.tokens: list[tuple[str, int]] = []  # (token, position)
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            m = _TOKEN.match(text, pos)
            if m is None:
                raise ValueError(f"unexpected {text[pos:].strip()[:10]!r} at position {pos} of {text!r}: "
                                 "only integers, + - * / // % ** and parentheses")
            self.tokens.append((m.group(1) or m.group(2), m.start(1) if m.group(1) else m.start(2)))
            pos = m.end()
        self.i = 0

    def parse(self) -> int:
        if not self.tokens:
            raise ValueError("empty expression")
        value = self._expr()
        if self.i < len(self.tokens):
            tok, pos = self.tokens[self.i]
            raise ValueError(f"unexpected {tok!r} at position {pos} of {self.text!r}")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.i][0] if self.i < len(self.tokens) else None

    def _take(self) -> str:
        if self.i >= len(self.tokens):
            raise ValueError(f"{self.text!r} ends too early")
        tok = self.tokens[self.i][0]
        self.i += 1
        return tok

    def _checked(self, value: int) -> int:
        if value and len(str(abs(value))) > self.max_digits:  # str of a ≤ max_digits-digit int is cheap
            raise ValueError(f"the result has more than {self.max_digits} digits")
        return value

    def _expr(self) -> int:
        value = self._term()
        while self._peek() in ("+", "-"):
            value = self._checked(value + self._term() if self._take() == "+" else value - self._term())
        return value

    def _term(self) -> int:
        value = self._unary()
        while self._peek() in ("*", "/", "//", "%"):
            op, rhs = self._take(), self._unary()
            if op == "*":
                if value and rhs and len(str(abs(value))) + len(str(abs(rhs))) > self.max_digits + 1:
                    raise ValueError(f"the result has more than {self.max_digits} digits")
                value = self._checked(value * rhs)
            elif rhs == 0:
                raise ValueError(f"division by zero in {self.text!r}")
            else:
                value = value % rhs if op == "%" else value // rhs
        return value

    def _power(self) -> int:
        base = self._atom()
        if self._peek() != "**":
            return base
        self._take()
        exponent = self._unary()
        if not 0 <= exponent <= MAX_EXPONENT:
            raise ValueError(f"exponent {exponent} outside 0..{MAX_EXPONENT} (integer arithmetic)")
        if abs(base) > 1 and exponent * len(str(abs(base))) > self.max_digits + exponent:
            raise ValueError(f"the result has more than {self.max_digits} digits")
        return self._checked(base**exponent)

    def _unary(self) -> int:
        if self._peek() in ("+", "-"):
            return -self._unary() if self._take() == "-" else self._unary()
        return self._power()

    def _atom(self) -> int:
        tok = self._take()
        if tok == "(":
            value = self._expr()
            if self._take() != ")":
                raise ValueError(f"missing ')' in {self.text!r}")
            return value
        if tok.isdigit():
            if len(tok) > self.max_digits:
                raise ValueError(f"a number of more than {self.max_digits} digits")
            return int(tok)
        raise ValueError(f"unexpected {tok!r} in {self.text!r}")
