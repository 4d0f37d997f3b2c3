"""The multi-turn rollout (``hybridrl.rollout.multi_turn``) on 1 and 2 gloo ranks: turns, tools, an environment and
their faults, with a scripted policy.

The policy here is a rollout engine that writes each episode's scripted turns (the case is named in the prompt), so
that every fault is produced on purpose; everything else is the real thing: the colocated engines' placement and
gathers, the rollout's turn loop and per-rank episode ownership, the calculator, the tool runner, the chat
template's rendering, the environment, the reward runner. Checked:

- the ids the policy sampled are kept verbatim (``loss_mask`` 1, their log-probs); everything between turns
  (``loss_mask`` 0, log-prob 0) is the template's render of the tool / environment messages, and the whole
  sample decodes to the template's render of its conversation;
- each fault — malformed JSON, an unknown tool, bad arguments, a tool that raises, one past ``tool_timeout_s``,
  an output past ``max_tool_response_length``, the ``python`` tool's infinite loop, fork bomb and memory hog, an
  environment that raises, hangs or returns garbage — becomes an observation (or ends the episode) within its limit
  plus a margin, and is counted in the step's metrics;
- one response budget over all turns; ``max_assistant_turns``; the environment's rewards reach the score;
- the same samples and metrics on 1 rank and on 2 (each episode acted on by one rank), and an environment that
  fails under ``reward.on_error=raise`` stops the step on every rank, naming it.

This file is also the ranks' worker (``python -m torch.distributed.run … test_multi_turn.py OUT``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridrl.interfaces import EnvStep, Generation, SamplingParams

TIMEOUT_S, ENV_TIMEOUT_S, BUDGET, MAX_TOOL_TOKENS = 3.0, 0.5, 600, 200
# the python tool's own wall limit: it answers before the runner's TIMEOUT_S, and after a fork bomb or a memory hog
# has met its own limit (under 1.2 s measured on a loaded 2-core machine), so every observation is the same each run
PY_TIMEOUT_S = 2.0


def call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# case -> the policy's turns (the last one repeats)
SCRIPTS: dict[str, list[str]] = {
    "direct": ["84"],  # no call: the environment rewards it
    "ok": [call("calculator", expression="12*7"), "84"],
    "two_calls": [call("calculator", expression="2+3") + call("calculator", expression="4*5"), "84"],
    "bad_json": ['<tool_call>{"name": calculator}</tool_call>', "84"],
    "unclosed": ['<tool_call>{"name": "calculator"', "84"],
    "unknown": [call("nope", x=1), "84"],
    "bad_args": [call("calculator", expression="2+"), "84"],
    "raises": [call("boom"), "84"],
    "slow": [call("sleepy"), "84"],
    "long": [call("chatty"), "84"],
    "wrong": ["3", "84"],  # the environment gives feedback, then rewards the second answer
    "env_raises": ["crash"],
    "env_hangs": ["hang"],
    "env_garbage": ["garbage"],
    "py_ok": [call("python", code="print(6*7)"), "84"],
    "py_loop": [call("python", code="while True: pass"), "84"],
    "py_fork": [call("python", code="import os\nwhile True: os.fork()"), "84"],
    "py_mem": [call("python", code="x = bytearray(2**34)"), "84"],
    "loop": [call("calculator", expression="1+1")],  # calls forever: max_assistant_turns ends it
    "budget": ["x" * (BUDGET - 30)] * 2,  # the second turn is cut by the response budget
}
CASES = list(SCRIPTS)
# a fork bomb's stderr holds the tracebacks of however many of its processes failed before the limit stopped it
VARIES = {"py_fork"}


class ScriptedPolicy:
    """A rollout engine that writes each episode's scripted turn (turn k = the k-th assistant prompt of its
    context)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int]) -> list[Generation]:
        assert params.n == 1
        out = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids)
            case = re.search(r"case:(\w+)", text).group(1)  # type: ignore[union-attr]
            k = text.count("<|im_start|>assistant\n") - 1
            turn = SCRIPTS[case][min(k, len(SCRIPTS[case]) - 1)]
            tokens = [*self.tok(turn, add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
            cut = tokens[:params.max_new_tokens]
            out.append(Generation(prompt_index=i, token_ids=cut, logprobs=[-0.01 * (j + 1) for j in range(len(cut))],
                                  finish_reason="stop" if len(cut) == len(tokens) else "length", weight_version=0))
        return out

    def update_weights(self, buckets, *, version: int) -> None: ...
    def release_memory(self) -> None: ...
    def resume_memory(self) -> None: ...
    def shutdown(self) -> None: ...


class ScriptedEnv:
    """Reward 1 for "84"; feedback once for another number; raises / hangs / returns garbage on those words."""

    class Config:
        pass

    def open(self, meta, *, seed: int) -> Any:
        env = self

        class Episode:
            tries = 0

            def step(self, message: dict[str, Any]) -> Any:
                content, self.tries = message["content"], self.tries + 1
                if content == "crash":
                    raise RuntimeError("the environment broke")
                if content == "hang":
                    time.sleep(30)
                if content == "garbage":
                    return {"messages": "nope"}
                if content == "84" or self.tries > 1:
                    return EnvStep(messages=[], done=True, reward=float(content == "84"))
                return EnvStep(messages=[{"role": "user", "content": "No. Try again."}], done=False, reward=-0.5)

        del env
        return Episode()


def _tools() -> dict[str, Any]:
    from hybridrl.tools.calculator import Calculator
    from hybridrl.tools.python import PythonTool

    def boom(arguments: dict) -> str:
        raise RuntimeError("tool exploded")

    def sleepy(arguments: dict) -> str:
        time.sleep(30)
        return "late"

    return {"calculator": Calculator(Calculator.Config()), "boom": boom, "sleepy": sleepy,
            "chatty": lambda arguments: "blah " * 100,
            "python": PythonTool(PythonTool.Config(timeout_s=PY_TIMEOUT_S, cpu_time_s=10, memory_mb=256,
                                                   max_processes=32))}


class Workers:
    """The rollout's engine workers (no trainers to offload here)."""

    def __init__(self, engines: Any) -> None:
        self.engines, self.weight_version = engines, 0

    @contextmanager
    def generating(self):
        with self.engines.awake():
            yield self.engines

    def sync_weights(self, *, version: int | None = None) -> float:
        return 0.0


def build(tmp: Path, *, on_error: str) -> tuple[Any, Any, Any]:
    import torch.distributed as dist

    from hybridrl.config.plan import Plan
    from hybridrl.config.schema import RLConfig
    from hybridrl.data.collate import collate_prompts
    from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
    from hybridrl.data.rows import write_rows
    from hybridrl.models.char_tokenizer import make_char_tokenizer
    from hybridrl.rewards.execution import RewardConfig, RewardRunner
    from hybridrl.rollout.colocated import ColocatedEngines
    from hybridrl.rollout.episodes import EpisodeActors
    from hybridrl.rollout.multi_turn import MultiTurnRollout
    from hybridrl.rollout.turns import TurnRenderer
    from hybridrl.tools.runner import ToolRunner, tokenizer_cut

    tok = make_char_tokenizer(model_max_length=4096)
    rows = [{"prompt": f"case:{c}", "ground_truth": "84"} for c in CASES]
    data = write_rows(rows, tmp / f"cases-{dist.get_rank()}.jsonl")
    dataset = PromptDataset([data], config=PromptDatasetConfig(max_prompt_length=64), tokenizer=tok)
    prompts = collate_prompts(dataset.items, list(range(len(rows))), pad_token_id=tok.pad_token_id)
    cfg = RLConfig()
    cfg.actor_rollout_ref.model.path = "unused"
    cfg.actor_rollout_ref.rollout.n = 1
    cfg.data.train_batch_size = len(rows)
    cfg.actor_rollout_ref.actor.ppo_mini_batch_size = cfg.data.train_batch_size
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1
    plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
    assert not problems, problems
    engines = ColocatedEngines(plan, build_engine=lambda **_: ScriptedPolicy(tok), pad_token_id=tok.pad_token_id)
    renderer = TurnRenderer(tok)
    renderer.check()
    actors = EpisodeActors(renderer, ToolRunner(_tools(), timeout_s=TIMEOUT_S, max_tokens=MAX_TOOL_TOKENS,
                                                cut=tokenizer_cut(tok)),
                           format="hermes", environment=ScriptedEnv(), environment_timeout_s=ENV_TIMEOUT_S,
                           max_assistant_turns=4)
    reward = RewardRunner.build(RewardConfig(name="environment", on_error=on_error), tokenizer=tok,
                                tokenizer_path="unused")
    params = SamplingParams(max_new_tokens=BUDGET, n=1)
    rollout = MultiTurnRollout(Workers(engines), prompts=iter([prompts]),
                               reward=reward, params=params, actors=actors, on_error=on_error,
                               environment="scripted")
    return rollout, tok, renderer


def main() -> None:
    import torch.distributed as dist

    from hybridrl.megatron.parallel import ParallelConfig, init_parallel
    from hybridrl.metrics import Timer

    init_parallel(ParallelConfig())
    out = Path(sys.argv[1])
    rollout, tok, _ = build(out, on_error="zero")
    t0 = time.monotonic()
    step = rollout.step(seed=3, timer=Timer())
    wall = time.monotonic() - t0
    scored = step.scores.result()
    b = step.batch
    result = {"wall": wall, "metrics": step.metrics, "errors": scored.errors,
              "scores": scored.output.scores_B.tolist(), "cases": [m.messages[0]["content"][5:] for m in b.meta],
              "ids": [b.response_ids[i][b.response_mask[i].bool()].tolist() for i in range(len(b))],
              "mask": [b.loss_mask[i][b.response_mask[i].bool()].tolist() for i in range(len(b))],
              "logprobs": [b.rollout_logprobs[i][b.response_mask[i].bool()].tolist() for i in range(len(b))],
              "prompts": [b.prompt_ids[i][b.prompt_mask[i].bool()].tolist() for i in range(len(b))],
              "finish": [m.finish_reason for m in b.meta], "env_error": [m.env_error for m in b.meta]}
    raising, _, _ = build(out, on_error="raise")
    try:
        raising.step(seed=3, timer=Timer())
        result["raised"] = None
    except Exception as e:  # noqa: BLE001
        result["raised"] = f"{type(e).__name__}: {e}"
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


def _run(torchrun, tmp: Path, nproc: int) -> dict[str, Any]:
    torchrun([__file__, str(tmp)], nproc=nproc, timeout=300)
    parts = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(nproc)]
    merged = {k: [x for p in parts for x in p[k]] for k in ("scores", "cases", "ids", "mask", "logprobs", "prompts",
                                                             "finish", "env_error")}
    assert all(p["metrics"] == parts[0]["metrics"] for p in parts)  # the step's metrics: the same on every rank
    return {**merged, "metrics": parts[0]["metrics"], "wall": max(p["wall"] for p in parts),
            "errors": sum(p["errors"] for p in parts), "raised": [p["raised"] for p in parts]}


@pytest.fixture(scope="module")
def one_rank(torchrun, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(torchrun, tmp_path_factory.mktemp("mt1"), 1)


@pytest.fixture(scope="module")
def two_ranks(torchrun, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(torchrun, tmp_path_factory.mktemp("mt2"), 2)


def _conversation(tok: Any, prompt: list[int], ids: list[int], mask: list[int]) -> tuple[list[dict], list[list[int]]]:
    """The sample's messages (ChatML blocks of its decoded text) and the ids of each policy turn."""
    text = tok.decode(prompt + ids)
    messages = [{"role": r, "content": c} for r, c in re.findall(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>|$)",
                                                                 text, re.S)]
    turns, cur = [], []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            turns.append(cur)
            cur = []
    return messages, [*turns, cur] if cur else turns


@pytest.mark.distributed
def test_turns_tools_environment_and_faults(one_rank: dict[str, Any]) -> None:
    from hybridrl.models.char_tokenizer import make_char_tokenizer

    tok = make_char_tokenizer(model_max_length=4096)
    r = one_rank
    by_case = {c: i for i, c in enumerate(r["cases"])}
    convo = {c: _conversation(tok, r["prompts"][i], r["ids"][i], r["mask"][i]) for c, i in by_case.items()}
    for c, i in by_case.items():
        messages, turns = convo[c]
        expected = SCRIPTS[c]
        for k, ids in enumerate(turns):  # the policy's ids, verbatim, with their log-probs
            script = [*tok(expected[min(k, len(expected) - 1)], add_special_tokens=False)["input_ids"],
                      tok.eos_token_id]
            assert ids == script[:len(ids)], (c, k)
        lp, mask = r["logprobs"][i], r["mask"][i]
        assert all(v == 0.0 for v, m in zip(lp, mask, strict=True) if not m), c  # appended ids: log-prob 0
        assert len(r["ids"][i]) <= BUDGET, c
        # the whole sample is the template's render of its conversation, up to its last sampled token
        text = tok.decode(r["prompts"][i] + r["ids"][i])
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert rendered.startswith(text) or text.startswith(rendered.removesuffix("\n")), c
        assert messages[0] == {"role": "user", "content": f"case:{c}"} and messages[1]["role"] == "assistant"
    tool_reply = {c: convo[c][0][2]["content"] for c in by_case
                  if convo[c][0][2:3] and convo[c][0][2]["role"] == "tool"}
    assert tool_reply["ok"] == "84"
    assert [m["content"] for m in convo["two_calls"][0][2:4]] == ["5", "20"]  # both calls, in order
    assert tool_reply["bad_json"].startswith("Error: the tool call could not be read: not JSON")
    assert "not closed" in tool_reply["unclosed"]
    assert tool_reply["unknown"].startswith("Error: unknown tool 'nope'") and "calculator" in tool_reply["unknown"]
    assert "raised ValueError" in tool_reply["bad_args"]
    assert "raised RuntimeError: tool exploded" in tool_reply["raises"]
    assert tool_reply["slow"] == f"Error: tool 'sleepy' took longer than {TIMEOUT_S:g} s"
    assert tool_reply["py_ok"] == "42\n"
    assert "TimeoutError" in tool_reply["py_loop"] and "time limit (timeout_s)" in tool_reply["py_loop"]
    assert "max_processes" in tool_reply["py_fork"], tool_reply["py_fork"]
    assert "memory_mb" in tool_reply["py_mem"], tool_reply["py_mem"]
    assert tool_reply["long"].endswith("[truncated]")
    assert len(tok(tool_reply["long"].removesuffix(" [truncated]"))["input_ids"]) == MAX_TOOL_TOKENS
    # the environment: feedback then the reward; its failures end the episode, scored 0, counted
    assert [m["content"] for m in convo["wrong"][0][1:4]] == ["3", "No. Try again.", "84"]
    assert r["scores"][by_case["wrong"]] == pytest.approx(0.5)  # -0.5 for the first try, +1 for the second
    assert r["scores"][by_case["ok"]] == 1.0  # the turn after the tool went to the environment
    for c, what in (("env_raises", "RuntimeError: the environment broke"), ("env_hangs", "took longer than"),
                    ("env_garbage", "not hybridrl.interfaces.EnvStep")):
        assert what in r["env_error"][by_case[c]], (c, r["env_error"][by_case[c]])
        assert r["scores"][by_case[c]] == 0.0
    assert r["errors"] == 3
    # limits: max_assistant_turns, the response budget
    assert len(convo["loop"][1]) == 4 and r["finish"][by_case["loop"]] == "stop"
    assert r["finish"][by_case["budget"]] == "length" and len(r["ids"][by_case["budget"]]) == BUDGET
    m = r["metrics"]
    cut = [c for c, text in tool_reply.items() if text.endswith(" [truncated]")]
    assert m["multi_turn/tool_timeouts"] == 1 and m["multi_turn/tool_truncated"] == len(cut)
    assert "long" in cut and all(len(tok(tool_reply[c].removesuffix(" [truncated]"))["input_ids"]) == MAX_TOOL_TOKENS
                                 for c in cut)
    assert m["multi_turn/tool_errors"] == 9  # bad_json, unclosed, unknown, bad_args, raises, slow, py_loop/fork/mem
    assert m["multi_turn/tool_calls"] == 1 + 2 + 1 + 1 + 1 + 1 + 1 + 1 + 1 + 4 + 3  # loop: 3 turns run their call
    assert m["multi_turn/env_errors"] == 3  # one of each kind
    assert [m[f"multi_turn/env_errors/{k}"] for k in ("step_raised", "step_timeout", "bad_step")] == [1, 1, 1]
    assert m["multi_turn/turns_mean"] == pytest.approx(sum(len(convo[c][1]) for c in by_case) / len(by_case))
    # every limit held: the step took about one tool timeout and one environment timeout, not the sleeps
    assert r["wall"] < TIMEOUT_S + ENV_TIMEOUT_S + 4.0, r["wall"]
    assert r["raised"][0].startswith("EnvironmentFailed: environment 'scripted'") and "sample" in r["raised"][0]


@pytest.mark.distributed
def test_two_ranks_give_the_same_samples(one_rank: dict[str, Any], two_ranks: dict[str, Any]) -> None:
    for key in ("cases", "mask", "logprobs", "scores", "finish", "metrics", "errors"):
        assert two_ranks[key] == one_rank[key], key
    for c, a, b, mask in zip(one_rank["cases"], one_rank["ids"], two_ranks["ids"], one_rank["mask"], strict=True):
        if c in VARIES:  # its sampled ids only: the observation's text differs from run to run
            a, b = [t for t, m in zip(a, mask, strict=True) if m], [t for t, m in zip(b, mask, strict=True) if m]
        assert a == b, c
    assert two_ranks["wall"] < TIMEOUT_S + ENV_TIMEOUT_S + 4.0
    assert all(x is not None and x.startswith("EnvironmentFailed") for x in two_ranks["raised"])  # on every rank


if __name__ == "__main__":
    main()
