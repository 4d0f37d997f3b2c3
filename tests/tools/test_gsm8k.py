"""The ``gsm8k`` tool (verl's ``calc_gsm8k_reward``) and how a tool gets the sample it serves (``takes_sample``):
the reply reads as verl's, from the ground truth of the call's own row; tools that do not ask are called as before."""

from __future__ import annotations

from typing import Any

import pytest

from hybridrl.batch import SampleMeta
from hybridrl.interfaces import ToolSample
from hybridrl.models.char_tokenizer import make_char_tokenizer
from hybridrl.testing import ContractViolation, check_tool
from hybridrl.tools.calls import parse_calls
from hybridrl.tools.gsm8k import Gsm8kTool
from hybridrl.tools.runner import ToolRunner, tokenizer_cut


def verl_row(ground_truth: Any, *, own: str | None = None) -> SampleMeta:
    """A row as verl's gsm8k_multiturn_w_tool preprocessing writes it: the tool's ground truth in extra_info."""
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": ground_truth}}}
    return SampleMeta(ground_truth=own, extra={"extra_info": {"split": "train", "tools_kwargs": kwargs}})


def reply(answer: Any, meta: SampleMeta) -> str:
    return Gsm8kTool()({"answer": answer}, sample=ToolSample.of(meta, "calc_gsm8k_reward"))


def test_right_wrong_and_unparsable_answers_read_as_verls_reply() -> None:
    row = verl_row("72", own="0")  # the tool's create_kwargs win over the row's own column, as in verl
    assert reply("72", row) == "Current parsed answer='72' reward=1.0"
    assert reply("#### 72", row) == "Current parsed answer='#### 72' reward=1.0"
    assert reply("She sold 48 + 24 = 72.0 clips", row).endswith("reward=1.0")  # the last number, by value
    assert reply(72, row) == "Current parsed answer='72' reward=1.0"  # a number, as some models write it
    assert reply("71", row) == "Current parsed answer='71' reward=0.0"
    assert reply("seventy-two", row) == "Current parsed answer='seventy-two' reward=0.0"
    assert reply("$1,000", verl_row(1000)).endswith("reward=1.0")  # separators and $ dropped; an int ground truth


def test_the_ground_truth_is_the_rows_own_where_verls_kwargs_are_missing() -> None:
    assert reply("18", SampleMeta(ground_truth="18")).endswith("reward=1.0")
    # a parquet struct unified over rows leaves None where a row has no kwargs
    empty = SampleMeta(ground_truth="Janet earns 9 * 2 = 18\n#### 18", extra={"extra_info": {"tools_kwargs": None}})
    assert reply("18", empty).endswith("reward=1.0")  # a whole GSM8K solution: the answer after ####
    assert reply("18", verl_row(None, own="17")).endswith("reward=0.0")
    with pytest.raises(ValueError, match="no ground truth.*create_kwargs.ground_truth.*data.ground_truth_key"):
        reply("18", SampleMeta())
    with pytest.raises(ValueError, match='takes {"answer"'):
        Gsm8kTool()({"value": "18"}, sample=ToolSample.of(SampleMeta(ground_truth="18"), "calc_gsm8k_reward"))


def test_the_contract_kit_calls_it_with_a_sample() -> None:
    check_tool(Gsm8kTool)
    check_tool(Gsm8kTool, arguments=[{"answer": "72"}], meta=verl_row("72"))

    class Vague(Gsm8kTool):
        takes_sample = 1  # type: ignore[assignment]

    with pytest.raises(ContractViolation, match="takes_sample must be True or False"):
        check_tool(Vague)


def test_the_runner_gives_each_call_its_own_sample_and_other_tools_only_their_arguments() -> None:
    def plain(arguments: dict[str, Any]) -> str:  # no takes_sample: one positional argument, as before
        return "plain " + arguments["x"]

    runner = ToolRunner({"calc_gsm8k_reward": Gsm8kTool(), "plain": plain}, timeout_s=5.0, max_tokens=100,
                        cut=tokenizer_cut(make_char_tokenizer(model_max_length=512)))
    calls = parse_calls('<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "5"}}</tool_call>'
                        '<tool_call>{"name": "plain", "arguments": {"x": "y"}}</tool_call>') * 2
    rows = [verl_row("5"), verl_row("5"), verl_row("6"), verl_row("6")]
    assert [o.text for o in runner.run(calls, metas=rows)] == [
        "Current parsed answer='5' reward=1.0", "plain y", "Current parsed answer='5' reward=0.0", "plain y"]
    without = runner.run(calls[:2])  # a caller that hands no samples: the tool that needs one says so
    assert without[0].error and "needs the sample it serves" in without[0].text and without[1].text == "plain y"
