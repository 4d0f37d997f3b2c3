"""The ``calculator`` tool (a parser, never ``eval``) and reading tool calls from an assistant turn (``hermes``)."""

from __future__ import annotations

import random

import pytest

from hybridrl.tools.calculator import Calculator, evaluate
from hybridrl.tools.calls import CallError, ToolCall, parse_calls


def _expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 3 or rng.random() < 0.3:
        return str(rng.randint(0, 99))
    kind = rng.choice(["bin", "bin", "neg", "paren", "pow"])
    if kind == "neg":
        return "-" + _expression(rng, depth + 1)
    if kind == "paren":
        return f"({_expression(rng, depth + 1)})"
    if kind == "pow":
        return f"{rng.randint(0, 9)}**{rng.randint(0, 3)}"
    return f"{_expression(rng, depth + 1)} {rng.choice(['+', '-', '*', '//', '%'])} {_expression(rng, depth + 1)}"


def test_random_expressions_agree_with_python() -> None:
    """Python's own integer semantics (precedence, -2**2, floor division and modulo of negatives)."""
    rng, checked = random.Random(0), 0
    for _ in range(2000):
        text = _expression(rng)
        try:
            want = eval(text)  # noqa: S307  (the reference, on generated integer arithmetic only)
        except ZeroDivisionError:
            with pytest.raises(ValueError, match="division by zero"):
                evaluate(text)
            continue
        assert evaluate(text) == want, text
        checked += 1
    assert checked > 1500
    assert evaluate("-2**2") == -4 and evaluate("2**3**2") == 512 and evaluate(" 17 * 23 ") == 391


@pytest.mark.parametrize(("text", "error"), [
    ("1.5*2", "only integers"), ("__import__('os')", "only integers"), ("2**-1", "exponent -1"),
    ("(1+2", "ends too early"), ("1 2", "unexpected '2'"), ("", "empty"), ("9**9**9", "exponent"),
    ("10**999 * 10**999", "more than 1000 digits"),
])
def test_what_is_not_integer_arithmetic_is_an_error_naming_it(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace("*", r"\*")):
        evaluate(text)


def test_the_tool_takes_one_expression_argument() -> None:
    calc = Calculator()
    assert calc({"expression": "12*(3+4)"}) == "84"
    assert calc.schema["function"]["name"] == "calculator"
    for bad in ({}, {"expression": 3}, {"expression": "1+1", "extra": 1}):
        with pytest.raises(ValueError, match="calculator takes"):
            calc(bad)
    with pytest.raises(ValueError, match="at most 5"):
        Calculator(Calculator.Config(max_length=5))({"expression": "1+2+3+4"})


def test_hermes_calls_are_read_and_malformed_ones_reported_not_dropped() -> None:
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
            '<tool_call>{bad json}</tool_call><tool_call>["x"]</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call><tool_call>{"name": "x"')
    calls = parse_calls(text)
    assert calls[0] == ToolCall(name="calculator", arguments={"expression": "2+3"})
    assert calls[3] == ToolCall(name="calculator", arguments={"expression": "1"})  # arguments as a JSON string
    errors = [c for c in calls if isinstance(c, CallError)]
    assert [e.message.split(" (")[0] for e in errors] == [
        "not JSON", 'expected {"name": "<tool>", "arguments": {...}}', "arguments must be an object, got list",
        "<tool_call> is not closed by </tool_call>"]
    assert parse_calls("The answer is 5.") == []
    with pytest.raises(ValueError, match="valid: hermes"):
        parse_calls("", format="xml")


def test_two_tools_the_policy_would_call_by_one_name_are_a_config_error() -> None:
    from hybridrl.tools.config import MultiTurnConfig, config_problems

    class Other(Calculator):  # another plugin whose schema also says "calculator"
        pass

    classes = {"calculator": Calculator, "my_calc": Other}
    problems = config_problems(MultiTurnConfig(enable=True, tools=["calculator", "my_calc"]),
                               load_tool=classes.__getitem__, check_kwargs=lambda *a: None,
                               environments=lambda name: object)
    keys = [(k, v) for k, v, _ in problems]
    assert ("actor_rollout_ref.rollout.multi_turn.tools", "my_calc") in keys
    assert any("calls itself 'calculator', as 'calculator' does" in m for _, _, m in problems)
