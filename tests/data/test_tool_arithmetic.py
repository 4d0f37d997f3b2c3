"""``grpo_tool_tiny``'s data (``hybridrl.data.tool_arithmetic``): 2-digit products to learn; a warm start that never
shows one, whose transcripts are token for token what the multi-turn rollout builds for the same conversation."""

from __future__ import annotations

import re

from hybridrl.data.tool_arithmetic import product_splits, tool_call_text, tool_sft_splits
from hybridrl.models.char_tokenizer import make_char_tokenizer
from hybridrl.rollout.turns import TurnRenderer
from hybridrl.tools.calculator import Calculator
from hybridrl.tools.calls import ToolCall, parse_calls


def test_products_are_2_digit_and_the_splits_disjoint() -> None:
    train, test = product_splits()
    for row in train + test:
        a, b = map(int, re.fullmatch(r"(\d+)\*(\d+)=", row["prompt"]).groups())  # type: ignore[union-attr]
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["ground_truth"] == str(a * b)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


def test_the_warm_start_never_shows_a_2_digit_product_and_calls_the_tool_half_the_time() -> None:
    """Products have a 1-digit operand and a 1–3 digit one (4-digit replies to copy), never two 2-digit ones."""
    train, test = tool_sft_splits()
    calls = [r for r in train if r["ground_truth"].startswith("<tool_call>")]
    assert 0.4 < len(calls) / len(train) < 0.6
    products = [re.fullmatch(r"(\d+)\*(\d+)=", r["prompt"]) for r in train + test if "*" in r["prompt"]]
    assert products and all(m is not None and min(len(m[1]), len(m[2])) == 1 for m in products)
    assert {(len(m[1]), len(m[2])) for m in products} == {(1, 1), (1, 2), (2, 1), (1, 3), (3, 1)}
    replies = [r["ground_truth"].rsplit("\n", 1)[-1] for r in calls]
    assert max(map(len, replies)) == 4  # 9*999=8991
    assert {r["prompt"][re.search(r"[-+*]", r["prompt"]).start()] for r in calls} == {"+", "-", "*"}  # type: ignore[union-attr]


def test_a_transcript_is_the_rollout_s_ids_for_that_conversation() -> None:
    """The SFT target of a tool call equals prompt → sampled call + EOS → the template's ids of the tool's reply →
    sampled answer + EOS, as TurnRenderer lays them out, and the call parses and runs."""
    tok = make_char_tokenizer(model_max_length=4096)
    row = next(r for r in tool_sft_splits()[0] if r["ground_truth"].startswith("<tool_call>"))
    (call,) = parse_calls(tool_call_text(row["prompt"].rstrip("=")))
    assert isinstance(call, ToolCall) and call.name == Calculator.schema["function"]["name"]
    answer = Calculator(Calculator.Config())(call.arguments)
    r = TurnRenderer(tok)
    user = [{"role": "user", "content": row["prompt"]}]
    sampled = [*r.encode(tool_call_text(row["prompt"].rstrip("="))), tok.eos_token_id]
    history = [*user, {"role": "assistant", "content": r.turn_text(sampled)}]
    appended = r.appended_ids(history, [{"role": "tool", "content": answer}], sampled_ids=sampled)
    rollout = sampled + appended + [*r.encode(answer), tok.eos_token_id]
    sft = [*tok(row["ground_truth"], add_special_tokens=False)["input_ids"], tok.eos_token_id]  # SFT appends EOS
    assert sft == rollout
