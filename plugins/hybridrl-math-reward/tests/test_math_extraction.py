"""Answer extraction by format, the fallbacks, and the guards that keep sympy from hanging."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hybridrl_math_reward import MathReward
from hybridrl_math_reward.equivalence import MAX_NESTING, nesting, parse_math
from hybridrl_math_reward.extraction import extract_answer, last_number
from transformers import PreTrainedTokenizerBase


@pytest.mark.parametrize(("text", "fmt", "answer", "formatted"), [
    ("5 + 7 = 12\n#### 12", "gsm8k", "12", True),
    ("#### 10\nno wait\n#### 1,250 dollars\nbye", "gsm8k", "1250 dollars", True),  # the last ####, its line
    ("so 3 + 4 = 7 hours", "gsm8k", "7", False),  # no ####: the last number
    ("x = \\boxed{\\frac{\\sqrt{3}}{2}} and", "boxed", "\\frac{\\sqrt{3}}{2}", True),  # braces matched
    ("\\boxed{2} then \\boxed{4}.", "boxed", "4", True),  # the last box
    ("The final answer is $\\frac{3}{4}$.", "boxed", "\\frac{3}{4}", False),  # math-verify's own extraction
    ("\\boxed{} so it is $5$", "boxed", "5", False),  # an empty box is no box
    ("it costs $-1,234.5 and 6 cents", "last_number", "6", True),
    ("it costs $-1,234.5", "last_number", "-1234.5", True),
    (".5 of it", "last_number", ".5", True),
])
def test_extract_by_format(text: str, fmt: str, answer: str, formatted: bool) -> None:
    found = extract_answer(text, fmt, max_chars=1000)  # type: ignore[arg-type]
    assert found is not None and (found.text, found.formatted) == (answer, formatted)


@pytest.mark.parametrize("fmt", ["gsm8k", "boxed", "last_number"])
def test_no_answer(fmt: str) -> None:
    assert extract_answer("I do not know.", fmt, max_chars=1000) is None  # type: ignore[arg-type]


def test_last_number() -> None:
    assert last_number("1,000,000 and 12,5") == "5"  # "12,5" is no thousands group
    assert last_number("from 1,000,000.25 down") == "1000000.25"
    assert last_number("none") is None


@pytest.mark.parametrize(("source", "fmt"), [("gsm8k", "gsm8k"), ("openai/gsm8k", "gsm8k"), ("GSM8K_test", "gsm8k"),
                                             ("math", "boxed"), ("hendrycks_math", "boxed"), ("", "boxed")])
def test_auto_picks_the_format_by_data_source(source: str, fmt: str, tokenizer: PreTrainedTokenizerBase) -> None:
    assert MathReward(MathReward.Config(), tokenizer=tokenizer).format_of(source) == fmt
    fixed = MathReward(MathReward.Config(extract="last_number"), tokenizer=tokenizer)
    assert fixed.format_of(source) == "last_number"


def test_an_answer_over_max_chars_is_not_parsed_and_matches_only_verbatim(tokenizer: PreTrainedTokenizerBase) -> None:
    reward = MathReward(MathReward.Config(max_answer_chars=8), tokenizer=tokenizer)
    long = "\\frac{10}{20}"  # 13 chars
    found = extract_answer(f"\\boxed{{{long}}}", "boxed", max_chars=8)
    assert found is not None and found.text == long and found.parsed == []
    assert not reward.judge(f"\\boxed{{{long}}}", ended=True, truth="\\frac{1}{2}").correct
    assert reward.judge(f"\\boxed{{{long}}}", ended=True, truth=long).correct
    assert reward.judge("\\boxed{0.5}", ended=True, truth="\\frac{1}{2}").correct  # short answers still parse


def test_nesting() -> None:
    assert nesting("\\left(\\frac{1}{2}\\right)") == 2
    assert nesting("}}}{{") == 2  # a stray closer does not make room
    deep = "{" * (MAX_NESTING + 1) + "1" + "}" * (MAX_NESTING + 1)
    assert parse_math(deep) == []
    assert parse_math("{" * MAX_NESTING + "1" + "}" * MAX_NESTING) != []


@pytest.mark.slow
def test_pathological_answers_finish_quickly() -> None:
    """Each of these hung sympy or ANTLR (for minutes or for good) before the guards; in a subprocess
    because such a hang holds the GIL, so nothing in this process could stop it."""
    code = textwrap.dedent(r'''
        import time
        from hybridrl_math_reward.equivalence import equivalent, parse_math
        bad = [r"10^{10^{10}}", r"9^{9^{9^{9}}}", r"(10^{10})!", r"\Gamma(10^{10})", r"99999999!",
               r"\frac{10^{10^{9}}}{3}", "^".join(["2"] * 300), r"(x+1)^{20000}", "{" * 20 + "1" + "}" * 20,
               "(" * 15 + "1" + ")" * 15]
        start = time.time()
        for answer in bad:
            assert not equivalent(parse_math("5"), parse_math(answer)), answer
            assert equivalent(parse_math(answer), parse_math(answer)) or parse_math(answer) == [], answer
        assert equivalent(parse_math("2^{2023}-1"), parse_math("2^{2023} - 1"))  # big but fine: still evaluated
        print(f"{time.time() - start:.1f}")
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split()[-1]) < 30
