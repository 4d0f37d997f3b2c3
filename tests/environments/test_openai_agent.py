"""The ``openai_agent`` environment: agent programs of plain ``openai`` client code (``tests/fixtures/agents/``) drive
episodes through the local chat-completions endpoint.

Checked: the contract kit passes; the endpoint speaks what the ``openai`` client expects (a 401 for an unknown key,
OpenAI-style 400s for what it does not support, the model list); each fault — a rewritten history, an assistant
message of the agent's own, a first request that is not the task, a crash, a hang, a refused ``stream=True``, an
exit before the first request, a missing program — fails the episode within its limit plus a margin, naming the
cause; Config errors name the field. In a real multi-turn rollout (1 gloo rank, a scripted policy) the agents'
messages reach the sample as the chat template's ids (``loss_mask`` 0) between the policy's turns, which keep the
engine's own ids and log-probs (``loss_mask`` 1); the agent's reward reaches the score; a crash is the sample's
``env_error``; ``max_assistant_turns`` ends a waiting agent's episode and ``close()`` kills it. Function calling
(an agent of the openai SDK's function-calling loop, its own calculator): the policy's calls reach it as
``tool_calls``, its results come back as tool messages under ``loss_mask`` 0, token-exact in the rollout; an
unreadable call and ``tool_choice="none"`` come back as text. The parameters agents send: ``max_tokens``, ``stop``,
``logprobs``, ``usage`` and streaming honoured (with the real ``hf`` engine and a tiny model too), sampling changes
refused naming the config key, and the episode survives each 400. After every test no
agent process (nor a child of one) is left: each carries :data:`MARK` in its environment, and none may be found.

This file is also the rollout's worker (``python -m torch.distributed.run … test_openai_agent.py OUT MARK``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hybridrl.batch import SampleMeta
from hybridrl.environments.chat_endpoint import ChatEndpoint, ChatRequest
from hybridrl.environments.openai_agent import AgentError, OpenAIAgent
from hybridrl.interfaces import EnvStep, Generation, SamplingParams

AGENTS = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
MARK = sys.argv[2] if __name__ == "__main__" else uuid.uuid4().hex  # the worker is given the test's
TASK: list[Any] = [{"role": "user", "content": "What is 2+3?"}]
TURNS = ["5", "Yes: 5.", "Still 5."]  # the scripted policy's turns, in every episode but calls_tools's
CALCULATOR = json.loads((AGENTS / "calculator_tools.json").read_text())  # the tools calls_tools.py offers
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'


def agent(name: str, *, env: dict[str, str] | None = None, **kw: Any) -> OpenAIAgent.Config:
    return OpenAIAgent.Config(command=["python", str(AGENTS / f"{name}.py")],
                              env={"HYBRIDRL_TEST_AGENT_MARK": MARK, **(env or {})}, **kw)


def marked() -> list[int]:
    """The live processes that carry :data:`MARK` (agents and their children)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"HYBRIDRL_TEST_AGENT_MARK={MARK}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone, or a zombie
            pass
    return found


@pytest.fixture(autouse=True)
def nothing_left_running() -> Iterator[None]:
    yield
    assert marked() == [], "agent processes outlived their test"


# ---- the environment on its own ------------------------------------------------------------------------


def test_the_contract_kit_passes() -> None:
    from hybridrl.testing import check_environment

    check_environment(OpenAIAgent, config=agent("ask_twice"), meta=SampleMeta(messages=TASK))


def test_an_episode_answers_each_request_and_ends_with_the_agents_reward() -> None:
    env = OpenAIAgent(agent("ask_twice"))
    try:
        t0 = time.monotonic()
        episode = env.open(SampleMeta(messages=TASK), seed=3)
        first = episode.step({"role": "assistant", "content": "5"})
        t1 = time.monotonic()
        last = episode.step({"role": "assistant", "content": "Yes: 5."})
        assert first == EnvStep(messages=[{"role": "user", "content": "Are you sure?"}], done=False)
        assert last == EnvStep(messages=[], done=True, reward=1.0, info={"returncode": 0})
        assert episode.history == [*TASK, {"role": "assistant", "content": "5"}, first.messages[0],
                                   {"role": "assistant", "content": "Yes: 5."}]
        assert "done asking" in episode.agent.stdout.text()
        episode.close()
        print(f"agent start + first request: {t1 - t0:.2f} s")
    finally:
        env.close()


def test_the_endpoint_speaks_openai() -> None:
    import openai

    endpoint = ChatEndpoint()
    try:
        delivered: list[ChatRequest] = []

        def answer(request: ChatRequest) -> None:
            delivered.append(request)
            request.reply({"role": "assistant", "content": "5"})

        key = endpoint.open_session(answer)
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["policy"]
        r = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is "}, {"type": "text", "text": "2+3?"}]}], temperature=0.1)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("5", "stop")
        assert delivered[0].messages == TASK  # text parts joined
        for kwargs, says in (({"n": 2}, "n=2 not supported"), ({"top_p": "high"}, "top_p='high': a number"),
                             ({"max_tokens": 0}, "max_tokens=0: an integer ≥ 1"),
                             ({"stop": [""]}, "stop=['']: a non-empty"),
                             ({"extra_body": {"best_of": 2}}, "best_of not supported by this endpoint"),
                             ({"frequency_penalty": 0.5}, "frequency_penalty=0.5 not supported"),
                             ({"response_format": {"type": "json_object"}}, "response_format="),
                             ({"top_logprobs": 2, "logprobs": True}, "only the sampled token's log-prob"),
                             ({"tools": [{"type": "function"}]}, "tools is a list of"),
                             ({"tools": CALCULATOR, "tool_choice": "required"}, "tool_choice='required' not supp"),
                             ({"tools": CALCULATOR, "parallel_tool_calls": False}, "parallel_tool_calls=false not"),
                             ({"functions": [{"name": "f"}]}, "not supported: deprecated by OpenAI")):
            with pytest.raises(openai.BadRequestError, match=re.escape(says)) as err:
                client.chat.completions.create(model="policy", messages=TASK, **kwargs)
            assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError, match="send its messages to POST /v1/chat/completions"):
            client.completions.create(model="policy", prompt="What is 2+3?")
        with pytest.raises(openai.AuthenticationError, match="unknown API key") as auth:
            openai.OpenAI(base_url=endpoint.base_url, api_key="sk-wrong", max_retries=0).models.list()
        assert auth.value.response.json()["error"]["code"] == "invalid_api_key"
        # one round trip of the request-reply path (the openai client's own work included)
        t0 = time.perf_counter()
        for _ in range(20):
            client.chat.completions.create(model="policy", messages=TASK)
        print(f"round trip: {(time.perf_counter() - t0) / 20 * 1e3:.1f} ms")
    finally:
        endpoint.shutdown()


@pytest.mark.parametrize(("name", "timeout_s", "says"), [
    pytest.param("rewrites_history", 30.0, "do not start with the conversation so far: message 1", id="rewrites"),
    pytest.param("speaks_for_policy", 30.0, "it sends an assistant message of its own", id="assistant"),
    pytest.param("adds_system_prompt", 30.0, "do not start with the task's messages", id="not_the_task"),
    pytest.param("crashes", 30.0, "exited with code 3; its stderr ends:\nthe agent gave up", id="crashes"),
    pytest.param("hangs", 2.0, "ran past timeout_s=2 s", id="hangs"),
    pytest.param("asks_for_two", 30.0, "exited with code 1 after its first request was refused with a 400 (n=2 not "
                 "supported", id="refused_first_request"),
])
def test_a_faulty_agent_fails_its_episode_in_time(name: str, timeout_s: float, says: str) -> None:
    env = OpenAIAgent(agent(name, timeout_s=timeout_s))
    try:
        t0 = time.monotonic()
        episode = env.open(SampleMeta(messages=TASK), seed=0)
        with pytest.raises(AgentError) as err:
            for turn in TURNS:
                episode.step({"role": "assistant", "content": turn})
        wall = time.monotonic() - t0
        assert says in str(err.value), str(err.value)
        if name == "asks_for_two":  # the endpoint's 400, as the openai client raised it in the agent
            assert "BadRequestError" in str(err.value) and "actor_rollout_ref.rollout.n" in str(err.value)
        assert wall < min(timeout_s, 10.0) + 3.0, wall  # the fault's own time (an agent's start) or timeout_s
        if name == "hangs":
            assert wall >= timeout_s
    finally:
        env.close()


def test_an_agent_that_never_asks_or_cannot_start() -> None:
    env = OpenAIAgent(OpenAIAgent.Config(command=["python", "-c", "print('hi')"], env={
        "HYBRIDRL_TEST_AGENT_MARK": MARK}))
    try:
        with pytest.raises(AgentError, match="exited with code 0 before its first request"):
            env.open(SampleMeta(messages=TASK), seed=0).step({"role": "assistant", "content": "5"})
        with pytest.raises(ValueError, match="SampleMeta.messages"):
            env.open(SampleMeta(), seed=0)
    finally:
        env.close()
    missing = OpenAIAgent(OpenAIAgent.Config(command=["/nonexistent/agent"]))
    with pytest.raises(AgentError, match=r"could not start command=\['/nonexistent/agent'\]"):
        missing.open(SampleMeta(messages=TASK), seed=0)
    missing.close()


def test_close_kills_a_waiting_agent_and_its_request_gets_an_error() -> None:
    env = OpenAIAgent(agent("patient"))
    try:
        episode = env.open(SampleMeta(messages=TASK), seed=0)
        assert not episode.step({"role": "assistant", "content": "5"}).done  # the agent now waits for a reply
        waiting = episode._waiting
        assert waiting is not None and not waiting.answered
        episode.close()
        assert waiting.answered and waiting._wait()[0] == 410
    finally:
        env.close()


# ---- the parameters agents send ----------------------------------------------------------------------------


def policy_turn(text: str, *, logprob: float = -0.5) -> Any:
    """``text`` as the policy's turn in the char tokenizer's ids (one per char, then the EOS), with log-probs that tell
    the ids apart, sampled at the default SamplingParams (temperature 1)."""
    from hybridrl.interfaces import PolicyTurn
    from hybridrl.models.char_tokenizer import make_char_tokenizer

    tok = make_char_tokenizer(model_max_length=4096)
    ids = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    return PolicyTurn(text=text, token_ids=ids, logprobs=[logprob - 0.01 * j for j in range(len(ids))],
                      context_tokens=10, params=SamplingParams(), eos_token_id=tok.eos_token_id,
                      decode=lambda x: str(tok.decode(list(x), skip_special_tokens=False)))


def asking(*asks: dict[str, Any], out: Path | None = None) -> OpenAIAgent.Config:
    writes = {"HYBRIDRL_TEST_OUT": str(out)} if out else {}
    return agent("asks", env={"HYBRIDRL_TEST_ASKS": json.dumps(asks), **writes})


def asked(output: str) -> list[dict[str, Any]]:
    """What asks.py got, each request's answer (or refusal) in order."""
    return [json.loads(line) for line in output.strip().splitlines() if not line.startswith('{"reward"')]


def test_max_tokens_stop_logprobs_and_usage_are_honoured_and_sampling_changes_refused_without_losing_the_episode(
        ) -> None:
    env = OpenAIAgent(asking({"max_tokens": 2, "logprobs": True}, {"stop": ["3", "x"]},
                             {"n": 2}, {"temperature": 0.3}, {"top_p": 0.5}, {"seed": 999},
                             {"temperature": 1.0, "top_p": 1, "seed": 7, "max_completion_tokens": 50}))
    try:
        episode = env.open(SampleMeta(messages=TASK), seed=7)
        capped = episode.step_turn(policy_turn("12345"))
        stopped = episode.step_turn(policy_turn("abc3def"))
        last = episode.step_turn(policy_turn("ok"))
        (a, b, *refused, c) = asked(episode.agent.stdout.text())
        # max_tokens=2: two tokens, finish "length"; the sample keeps the first 2 ids, as sampled
        assert (a["choices"][0]["message"]["content"], a["choices"][0]["finish_reason"]) == ("12", "length")
        assert a["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                              "completion_tokens_details": None, "prompt_tokens_details": None}
        assert [(t["token"], t["logprob"]) for t in a["choices"][0]["logprobs"]["content"]] == [("1", -0.5),
                                                                                                  ("2", -0.51)]
        assert capped.keep_tokens == 2 and not capped.done
        # stop: the content ends before the stop string; the sample keeps the ids up to the one that completed it
        assert (b["choices"][0]["message"]["content"], b["choices"][0]["finish_reason"]) == ("abc", "stop")
        assert b["choices"][0]["logprobs"] is None and b["usage"]["completion_tokens"] == 4
        assert stopped.keep_tokens == 4 and stopped.messages == [{"role": "user", "content": "Go on."}]
        # refused, each naming what sets it, and the episode went on: the retry was answered
        assert "n=2 not supported" in refused[0]["refused"] and "actor_rollout_ref.rollout.n" in refused[0]["refused"]
        assert "temperature=0.3 differs from the run's 1" in refused[1]["refused"]
        assert "actor_rollout_ref.rollout.temperature" in refused[1]["refused"]
        assert "actor_rollout_ref.rollout.top_p" in refused[2]["refused"]
        assert "seed=999 differs" in refused[3]["refused"] and "trainer.seed" in refused[3]["refused"]
        assert (c["choices"][0]["message"]["content"], c["choices"][0]["finish_reason"]) == ("ok", "stop")
        assert c["usage"]["completion_tokens"] == 3  # "o", "k" and the EOS
        assert last.done and last.keep_tokens is None and last.reward == 1.0
    finally:
        env.close()


def test_with_the_hf_engine_capped_turns_keep_their_sampled_ids_and_logprobs(tmp_path: Path) -> None:
    """The real ``hf`` engine and a tiny random model drive an agent's episode (the rollout's turn loop of an engine
    rank, :func:`~hybridrl.rollout.multi_turn.play_share`): ``max_tokens=2`` gives ≤ 2 completion tokens with the
    engine's log-probs, a refused ``n=2`` is survived, and the sample is the sampled ids up to each cut (their
    log-probs as sampled, ``loss_mask`` 1) and the template's ids between (``loss_mask`` 0); the second turn was
    generated from exactly that context. ~6 s: the model's build, the agent's start and two turns on CPU."""
    from transformers import AutoTokenizer

    from hybridrl.models.tiny import make_tiny_model
    from hybridrl.registry import Registry
    from hybridrl.rollout.episodes import EpisodeActors
    from hybridrl.rollout.multi_turn import play_share
    from hybridrl.rollout.turns import TurnRenderer
    from hybridrl.tools.runner import ToolRunner, tokenizer_cut

    path = make_tiny_model(tmp_path / "model", hidden=64, layers=2, heads=4, kv_heads=2, seed=1)
    tok = AutoTokenizer.from_pretrained(path)
    engine = Registry("rollout_engines").build("hf", {}, key="actor_rollout_ref.rollout.engine_kwargs",
                                               model_path=str(path))
    made: list[tuple[list[int], Generation]] = []  # (context, the engine's turn)

    def generate(contexts: Any, params: SamplingParams, *, seeds: Any, max_new_tokens: Any = None) -> Any:
        gens = engine.generate(contexts, params, seeds=seeds, max_new_tokens=max_new_tokens)
        made.extend((list(c), g) for c, g in zip(contexts, gens, strict=True))
        return gens

    out = tmp_path / "asked.jsonl"
    env: Any = OpenAIAgent(asking({"max_tokens": 2, "logprobs": True}, {"n": 2}, {"max_tokens": 3, "logprobs": True},
                                  out=out))
    renderer = TurnRenderer(tok)
    actors = EpisodeActors(renderer, ToolRunner({}, timeout_s=1.0, max_tokens=16, cut=tokenizer_cut(tok)),
                           format="hermes", environment=env, environment_timeout_s=30.0, max_assistant_turns=3)
    prompt = renderer.prompt_ids(TASK)
    try:
        episodes = play_share(actors, range(1), [prompt], [SampleMeta(messages=TASK)],
                              SamplingParams(temperature=1.0, max_new_tokens=400), seed=5, generate=generate)
    finally:
        env.close()
    first, refused, second = asked(out.read_text())
    (c1, g1), (c2, g2) = made
    k1, k2 = min(2, len(g1.token_ids)), min(3, len(g2.token_ids))
    assert len(g1.token_ids) > 2 and first["choices"][0]["finish_reason"] == "length"  # the engine wrote more
    assert first["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 2, "total_tokens": len(prompt) + 2,
                              "completion_tokens_details": None, "prompt_tokens_details": None}
    assert [t["logprob"] for t in first["choices"][0]["logprobs"]["content"]] == g1.logprobs[:k1]
    assert first["choices"][0]["message"]["content"] == tok.decode(g1.token_ids[:k1])
    assert "actor_rollout_ref.rollout.n" in refused["refused"]
    gap = renderer.appended_ids([*TASK, {"role": "assistant", "content": renderer.turn_text(g1.token_ids[:k1])}],
                                [{"role": "user", "content": "Go on."}], sampled_ids=g1.token_ids[:k1])
    assert c1 == prompt and c2 == prompt + g1.token_ids[:k1] + gap  # turn 2 saw the cut turn, ended by the template
    assert second["usage"]["prompt_tokens"] == len(c2) and second["usage"]["completion_tokens"] == k2
    (g,) = episodes.gens
    assert g.token_ids == g1.token_ids[:k1] + gap + g2.token_ids[:k2]
    assert g.loss_mask == [1] * k1 + [0] * len(gap) + [1] * k2
    assert g.logprobs == g1.logprobs[:k1] + [0.0] * len(gap) + g2.logprobs[:k2]
    assert episodes.env == [(1.0, None)]


def test_streaming_sends_the_reply_as_chunks_with_usage() -> None:
    env = OpenAIAgent(asking({"stream": True, "stream_options": {"include_usage": True}}, {"stream": True}))
    try:
        episode = env.open(SampleMeta(messages=TASK), seed=0)
        episode.step_turn(policy_turn("Hi there"))
        assert episode.step_turn(policy_turn("Bye")).done
        (a, b) = asked(episode.agent.stdout.text())
        deltas = [(c["choices"][0]["delta"]["content"], c["choices"][0]["finish_reason"]) for c in a["chunks"][:-1]]
        assert deltas == [("", None), ("Hi there", None), (None, "stop")]
        assert a["chunks"][-1]["choices"] == [] and a["chunks"][-1]["usage"]["completion_tokens"] == 9
        assert all(c["usage"] is None for c in b["chunks"])
        assert b["chunks"][1]["choices"][0]["delta"]["content"] == "Bye"
    finally:
        env.close()


def test_tool_calls_stream_as_deltas() -> None:
    import openai

    endpoint = ChatEndpoint()
    try:
        call = {"id": "call_1", "type": "function", "function": {"name": "calculator",
                                                                 "arguments": '{"expression": "12*7"}'}}
        key = endpoint.open_session(lambda r: r.reply({"role": "assistant", "content": None, "tool_calls": [call]}))
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0)
        chunks = list(client.chat.completions.create(model="policy", messages=TASK, tools=CALCULATOR, stream=True))
        calls = [d.tool_calls[0] for c in chunks if (d := c.choices[0].delta).tool_calls]
        assert (calls[0].index, calls[0].id, calls[0].function.name) == (0, "call_1", "calculator")  # type: ignore[union-attr]
        assert "".join(c.function.arguments for c in calls) == '{"expression": "12*7"}'  # type: ignore[union-attr,misc]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        endpoint.shutdown()


# ---- function calling ------------------------------------------------------------------------------------


def seen_by(episode: Any) -> list[dict[str, Any]]:
    """What calls_tools.py printed of each reply it got (its next-to-last stdout line)."""
    return json.loads(episode.agent.stdout.text().strip().splitlines()[-2])  # type: ignore[no-any-return]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_policys_calls_reach_the_agent_as_tool_calls_and_its_results_come_back_as_tool_messages(
        stream: bool) -> None:
    env = OpenAIAgent(agent("calls_tools", tools=CALCULATOR, env={"HYBRIDRL_TEST_STREAM": "1"} if stream else {}))
    try:
        assert env.tools == CALCULATOR  # rendered into the prompts (hybridrl.rollout.episodes.tool_schemas)
        episode = env.open(SampleMeta(messages=TASK), seed=0)
        two = CALL + "\n" + CALL.replace("12*7", "(2+3)*1")
        first = episode.step({"role": "assistant", "content": "Let me compute.\n" + two})
        last = episode.step({"role": "assistant", "content": "84 and 5."})
        (calls_reply, text_reply) = seen_by(episode)
        assert calls_reply["finish"] == "tool_calls" and calls_reply["content"] == "Let me compute."
        (id1, name1, args1), (id2, name2, args2) = calls_reply["calls"]
        assert (name1, json.loads(args1), name2, json.loads(args2)) == (
            "calculator", {"expression": "12*7"}, "calculator", {"expression": "(2+3)*1"})
        assert id1.startswith("call_") and id1 != id2
        assert first == EnvStep(messages=[{"role": "tool", "content": "84", "tool_call_id": id1},
                                          {"role": "tool", "content": "5", "tool_call_id": id2}], done=False)
        assert text_reply == {"finish": "stop", "content": "84 and 5.", "calls": []}
        assert last.done and last.reward == 1.0
    finally:
        env.close()


def test_a_langchain_bind_tools_agent_runs_unchanged() -> None:
    """LangChain's ``ChatOpenAI.bind_tools`` loop (langchain-openai, in the test extra): the fields it sends are
    served, the policy's call reaches it as a tool call, its ``ToolMessage`` comes back as a tool message. ~10 s,
    most of it LangChain's import in the agent."""
    pytest.importorskip("langchain_openai")
    env = OpenAIAgent(agent("langchain_tools", tools=CALCULATOR))
    try:
        episode = env.open(SampleMeta(messages=TASK), seed=0)
        first = episode.step_turn(policy_turn("Let me compute.\n" + CALL))
        assert episode.step_turn(policy_turn("84.")).done
        (calls_reply, text_reply) = seen_by(episode)
        ((call_id, name, args),) = calls_reply["calls"]
        assert (calls_reply["content"], name, args) == ("Let me compute.", "calculator", {"expression": "12*7"})
        assert first.messages == [{"role": "tool", "content": "84", "tool_call_id": call_id}]
        assert text_reply == {"content": "84.", "calls": []}
    finally:
        env.close()


def test_the_agent_tools_recipe_renders_the_agents_calculator_and_its_agent_answers_calls() -> None:
    """``recipe=grpo_agent_tools_tiny``: the prompts show the agent's calculator, the same schema the rollout's own
    ``calculator`` has (the warm start's), none of the rollout's tools; its agent runs the policy's call like the
    built-in calculator would, and ends on the answer."""
    from hybridrl.config.compose import compose_config
    from hybridrl.config.plugin_kwargs import resolve_plugin_kwargs
    from hybridrl.rollout.episodes import build_environment, build_tools, tool_schemas
    from hybridrl.tools.calculator import Calculator

    cfg = compose_config(["recipe=grpo_agent_tools_tiny"])
    resolve_plugin_kwargs(cfg)  # the recipe's openai_agent block as its kwargs, as validation does first
    assert tool_schemas(cfg) == [Calculator.schema] and build_tools(cfg) == []
    env: Any = build_environment(cfg)
    env.config.env = {"HYBRIDRL_TEST_AGENT_MARK": MARK}
    try:
        episode = env.open(SampleMeta(messages=[{"role": "user", "content": "37*58="}]), seed=0)
        call = '<tool_call>{"name":"calculator","arguments":{"expression":"37*58"}}</tool_call>'
        wrong = '<tool_call>{"name":"calculator","arguments":{"expression":"37*"}}</tool_call>'
        first = episode.step_turn(policy_turn(call + "\n" + wrong))
        right, error = (m["content"] for m in first.messages)
        assert right == "2146" == Calculator()({"expression": "37*58"}) and error.startswith("Error: "), error
        assert episode.step_turn(policy_turn("2146")).done
    finally:
        env.close()


@pytest.mark.parametrize(("turn", "choice"), [
    pytest.param(CALL.replace('"name": "calculator"', "name: calculator"), None, id="unreadable"),
    pytest.param(CALL.removesuffix("</tool_call>"), None, id="unclosed"),
    pytest.param(CALL, "none", id="tool_choice_none"),
])
def test_a_call_that_cannot_be_read_or_is_not_wanted_comes_back_as_text(turn: str, choice: str | None) -> None:
    choosing = {"HYBRIDRL_TEST_TOOL_CHOICE": choice} if choice else {}
    env = OpenAIAgent(agent("calls_tools", tools=CALCULATOR, env=choosing))
    try:
        episode = env.open(SampleMeta(messages=TASK), seed=0)
        assert episode.step({"role": "assistant", "content": turn}).done
        assert seen_by(episode) == [{"finish": "stop", "content": turn, "calls": []}]
    finally:
        env.close()


def test_an_agent_whose_tools_are_not_the_prompts_fails_naming_the_key() -> None:
    env = OpenAIAgent(agent("calls_tools"))  # no tools= configured: the prompt shows none
    try:
        episode = env.open(SampleMeta(messages=TASK), seed=0)
        with pytest.raises(AgentError, match=re.escape("multi_turn.environment_kwargs.tools=[]")):
            episode.step({"role": "assistant", "content": CALL})
    finally:
        env.close()


def test_the_agent_sees_the_rows_ground_truth_and_other_fields_and_scores_itself(tmp_path: Path) -> None:
    from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
    from hybridrl.data.rows import write_rows
    from hybridrl.models.char_tokenizer import make_char_tokenizer

    rows = [{"prompt": "What is 2+3?", "ground_truth": "5", "data_source": "sums", "level": 2, "tags": ["easy"]}]
    dataset = PromptDataset([write_rows(rows, tmp_path / "rows.jsonl")], config=PromptDatasetConfig(
        max_prompt_length=64), tokenizer=make_char_tokenizer(model_max_length=4096))
    meta = dataset.items[0].meta  # as the dataset gives it to the rollout
    env = OpenAIAgent(agent("scores_itself"))
    try:
        right, wrong = env.open(meta, seed=0), env.open(meta, seed=1)
        assert right.step({"role": "assistant", "content": "5"}).reward == 1.0
        assert wrong.step({"role": "assistant", "content": "4"}).reward == 0.0
        given = json.loads(right.agent.stdout.text().strip().splitlines()[-2])
        assert given == {"HYBRIDRL_GROUND_TRUTH": "5", "HYBRIDRL_DATA_SOURCE": "sums",
                         "HYBRIDRL_EXTRA": json.dumps({"level": 2, "tags": ["easy"]})}
    finally:
        env.close()
    with pytest.raises(ValueError, match=re.escape("env sets ['HYBRIDRL_GROUND_TRUTH']")):
        OpenAIAgent.Config(command=["a"], env={"HYBRIDRL_GROUND_TRUTH": "x"})


def test_config_errors_name_the_field() -> None:
    from hybridrl.registry import PluginConfigError, make_plugin_config

    for kwargs, field in (({"command": []}, "command="), ({"command": ["python", ""]}, "command="),
                          ({"command": ["a"], "timeout_s": 0.0}, "timeout_s=0.0"),
                          ({"command": ["a"], "env": {"OPENAI_API_KEY": "x"}}, "env sets ['OPENAI_API_KEY']"),
                          ({"command": ["a"], "env": {"X": 1}}, "env="),
                          ({"command": ["a"], "tools": [{"name": "f"}]}, "tools=[{'name': 'f'}] must be")):
        with pytest.raises(ValueError, match=re.escape(field)):
            OpenAIAgent.Config(**kwargs)
    key = "actor_rollout_ref.rollout.multi_turn.environment_kwargs"
    with pytest.raises(PluginConfigError, match=re.escape(f"missing required key {key}.command")):
        make_plugin_config(OpenAIAgent, "openai_agent", {}, key=key)


# ---- in a multi-turn rollout ---------------------------------------------------------------------------

# case -> its policy turns (≤ 3)
CASES = {"ask_twice": 2, "patient": 3, "crashes": 1, "calls_tools": 2, "asks": 2, "asks_for_two": 1}
ASKS = [{"max_tokens": 1}, {"n": 2}, {}]  # the asks case: its first turn cut to 1 token, a refused request retried
SCRIPTS = {"calls_tools": ["Let me compute.\n" + CALL, "84."]}  # its turns; the other cases': TURNS
# ChatML with the tools in a system block, as Qwen's template renders them
TOOLS_TEMPLATE = ("{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson }}"
                  "{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}")


def tools_tokenizer() -> Any:
    from hybridrl.models.char_tokenizer import CHAT_TEMPLATE, make_char_tokenizer

    tok = make_char_tokenizer(model_max_length=4096)
    tok.chat_template = TOOLS_TEMPLATE + CHAT_TEMPLATE
    return tok


class ScriptedPolicy:
    """A rollout engine that writes :data:`TURNS` (turn k of an episode = the k-th assistant prompt of its context),
    with log-probs that tell the turns apart; it keeps what it generated."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.made: list[tuple[str, int, list[int], list[float]]] = []  # (case, turn, ids, logprobs)

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seeds: list[int]) -> list[Generation]:
        out = []
        for i, ids in enumerate(prompts):
            text = self.tok.decode(ids)
            case = re.search(r"case:(\w+)", text).group(1)  # type: ignore[union-attr]
            k = text.count("<|im_start|>assistant\n") - 1
            turn = SCRIPTS.get(case, TURNS)[k]
            tokens = [*self.tok(turn, add_special_tokens=False)["input_ids"], self.tok.eos_token_id]
            logprobs = [-0.1 * (k + 1) - 0.001 * j for j in range(len(tokens))]
            self.made.append((case, k, tokens, logprobs))
            out.append(Generation(prompt_index=i, token_ids=tokens, logprobs=logprobs, finish_reason="stop",
                                  weight_version=0))
        return out

    def update_weights(self, buckets: Any, *, version: int) -> None: ...
    def release_memory(self) -> None: ...
    def resume_memory(self) -> None: ...
    def shutdown(self) -> None: ...


class Workers:
    def __init__(self, engines: Any) -> None:
        self.engines, self.weight_version = engines, 0

    @contextmanager
    def generating(self) -> Iterator[Any]:
        with self.engines.awake():
            yield self.engines

    def sync_weights(self, *, version: int | None = None) -> float:
        return 0.0


def main() -> None:
    import torch
    import torch.distributed as dist

    from hybridrl.config.plan import Plan
    from hybridrl.config.schema import RLConfig
    from hybridrl.data.collate import collate_prompts
    from hybridrl.data.dataset import PromptDataset, PromptDatasetConfig
    from hybridrl.data.rows import write_rows
    from hybridrl.megatron.parallel import ParallelConfig, init_parallel
    from hybridrl.metrics import Timer
    from hybridrl.rewards.execution import RewardConfig, RewardRunner
    from hybridrl.rollout.colocated import ColocatedEngines
    from hybridrl.rollout.episodes import EpisodeActors
    from hybridrl.rollout.multi_turn import MultiTurnRollout
    from hybridrl.rollout.turns import TurnRenderer
    from hybridrl.tools.runner import ToolRunner, tokenizer_cut
    from hybridrl.trainers.rollout_dump import rows as dump_rows

    init_parallel(ParallelConfig())
    out = Path(sys.argv[1])
    tok = tools_tokenizer()
    rows = [{"prompt": f"case:{c} What is 2+3?", "ground_truth": "5"} for c in CASES]
    data = write_rows(rows, out / f"cases-{dist.get_rank()}.jsonl")
    dataset = PromptDataset([data], config=PromptDatasetConfig(max_prompt_length=1024, tools=CALCULATOR),
                            tokenizer=tok)
    prompts = collate_prompts(dataset.items, list(range(len(rows))), pad_token_id=tok.pad_token_id)
    cfg = RLConfig()
    cfg.actor_rollout_ref.model.path = "unused"
    cfg.actor_rollout_ref.rollout.n = 1
    cfg.data.train_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size = len(rows)
    cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu = 1
    plan, problems = Plan.build(cfg, world_size=dist.get_world_size(), device_type="cpu")
    assert not problems, problems
    policy: Any = ScriptedPolicy(tok)
    engines = ColocatedEngines(plan, build_engine=lambda **_: policy, pad_token_id=tok.pad_token_id)
    renderer = TurnRenderer(tok, tools=CALCULATOR)  # the agent's tools, as hybridrl.rollout.episodes renders them
    renderer.check()
    # Any: mypy takes a nested Config for an instance variable
    env: Any = OpenAIAgent(agent("by_case", timeout_s=60.0, tools=CALCULATOR,
                                 env={"HYBRIDRL_TEST_ASKS": json.dumps(ASKS)}))
    actors = EpisodeActors(renderer, ToolRunner({}, timeout_s=1.0, max_tokens=16, cut=tokenizer_cut(tok)),
                           format="hermes", environment=env, environment_timeout_s=20.0, max_assistant_turns=3)
    reward = RewardRunner.build(RewardConfig(name="environment", on_error="zero"), tokenizer=tok,
                                tokenizer_path="unused")
    rollout = MultiTurnRollout(Workers(engines), prompts=iter([prompts]), reward=reward,
                               params=SamplingParams(max_new_tokens=200, n=1), actors=actors, on_error="zero",
                               environment="openai_agent")
    t0 = time.monotonic()
    step = rollout.step(seed=1, timer=Timer())
    wall = time.monotonic() - t0
    left_after_step = marked()  # the episodes are over: close() killed the one still waiting
    env.close()
    scored, b = step.scores.result(), step.batch
    rows_of = [re.search(r"case:(\w+)", str(m.messages)).group(1) for m in b.meta]  # type: ignore[union-attr]
    real = [b.response_mask[i].bool() for i in range(len(b))]
    torch.save({"wall": wall, "left": left_after_step, "errors": scored.errors, "made": policy.made,
                "cases": rows_of, "scores": scored.output.scores_B.tolist(),
                "ids": [b.response_ids[i][m].tolist() for i, m in enumerate(real)],
                "mask": [b.loss_mask[i][m].tolist() for i, m in enumerate(real)],
                "logprobs": [b.rollout_logprobs[i][m].tolist() for i, m in enumerate(real)],
                "prompts": [b.prompt_ids[i][b.prompt_mask[i].bool()].tolist() for i in range(len(b))],
                "messages": [m.messages for m in b.meta], "env_error": [m.env_error for m in b.meta],
                "finish": [m.finish_reason for m in b.meta], "turns": step.metrics["multi_turn/turns_mean"],
                "tool_calls": step.metrics["multi_turn/tool_calls"], "metrics": step.metrics,
                "dump": dump_rows(b, scored.output.scores_B, tok, 1)},
               out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


@pytest.mark.distributed
def test_agents_drive_episodes_of_a_multi_turn_rollout(torchrun: Any, tmp_path: Path) -> None:
    import torch

    from hybridrl.rollout.turns import TurnRenderer

    log = torchrun([__file__, str(tmp_path), MARK], nproc=1, timeout=120).stdout
    r = torch.load(tmp_path / "rank0.pt", weights_only=False)
    tok = tools_tokenizer()
    assert sorted(r["cases"]) == sorted(CASES) and r["left"] == []
    for i, case in enumerate(r["cases"]):
        ids, mask, logprobs = r["ids"][i], r["mask"][i], r["logprobs"][i]
        # loss_mask 1 exactly on the engine's sampled ids, turn by turn, with the engine's log-probs
        made = sorted((k, t, lp) for c, k, t, lp in r["made"] if c == case)
        assert len(made) == CASES[case], case
        if case == "asks":  # max_tokens=1: the first turn keeps its first sampled id
            made[0] = (made[0][0], made[0][1][:1], made[0][2][:1])
        assert [t for i_, t in enumerate(ids) if mask[i_]] == [t for _, turn, _ in made for t in turn], case
        assert [lp for i_, lp in enumerate(logprobs) if mask[i_]] == pytest.approx(
            [v for _, _, lps in made for v in lps], abs=1e-7), case
        assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m), case
        # the sample is the template's render of the conversation: the agent's messages between the policy's turns
        conversation = [*r["messages"][i]]
        between = {"role": "tool", "content": "84"} if case == "calls_tools" else {
            "role": "user", "content": "Go on." if case == "asks" else "Are you sure?"}
        for k in range(CASES[case]):
            if k:
                conversation.append(between)
            conversation.append({"role": "assistant", "content": SCRIPTS.get(case, TURNS)[k]})
        rendered = tok.apply_chat_template(conversation, tools=CALCULATOR, tokenize=False)  # the tools in the prompt
        assert str(tok.decode(r["prompts"][i] + ids)) + "\n" == rendered, case
    by = {c: i for i, c in enumerate(r["cases"])}
    # ask_twice's response, spelled out: policy turn 1 + the template's ids of the agent's message + policy turn 2
    t1, t2 = (t for _, t in sorted((k, t) for c, k, t, _ in r["made"] if c == "ask_twice"))
    between = TurnRenderer(tok, tools=CALCULATOR).appended_ids(
        [*r["messages"][by["ask_twice"]], {"role": "assistant", "content": "5"}],
        [{"role": "user", "content": "Are you sure?"}], sampled_ids=t1)
    assert r["ids"][by["ask_twice"]] == t1 + between + t2
    assert r["mask"][by["ask_twice"]] == [1] * len(t1) + [0] * len(between) + [1] * len(t2)
    assert r["scores"][by["ask_twice"]] == 1.0 and r["env_error"][by["ask_twice"]] is None
    assert r["env_error"][by["patient"]] is None and r["finish"][by["patient"]] == "stop"  # max turns ended it
    assert "exited with code 3" in r["env_error"][by["crashes"]] and r["scores"][by["crashes"]] == 0.0
    assert r["errors"] == 2
    # the failed episodes' reasons: in the dump, counted by kind, the distinct ones in the log; a first request
    # refused with a 400 is reported as such
    dumped = {c: row["env_error"] for c, row in zip(r["cases"], r["dump"], strict=True)}
    assert "exited with code 3" in dumped["crashes"] and dumped["ask_twice"] is None
    assert "exited with code 1 after its first request was refused with a 400 (n=2" in dumped["asks_for_two"]
    assert r["metrics"]["multi_turn/env_errors"] == 2.0
    assert r["metrics"]["multi_turn/env_errors/agent_exited"] == 1.0
    assert r["metrics"]["multi_turn/env_errors/agent_refused"] == 1.0
    (line,) = [x for x in log.splitlines() if "episodes failed" in x]
    assert "2 of 6 episodes failed" in line and "agent_exited 1, agent_refused 1" in line, line
    assert "exited with code 3" in line and "after its first request was refused" in line, line
    # function calling: the policy's call went to the agent, which ran its calculator; "84" came back as a tool
    # message (the template's ids, loss_mask 0), the rollout's own tools ran nothing
    i = by["calls_tools"]
    t1, t2 = (t for _, t in sorted((k, t) for c, k, t, _ in r["made"] if c == "calls_tools"))
    result = TurnRenderer(tok, tools=CALCULATOR).appended_ids(
        [*r["messages"][i], {"role": "assistant", "content": SCRIPTS["calls_tools"][0]}],
        [{"role": "tool", "content": "84"}], sampled_ids=t1)
    assert r["ids"][i] == t1 + result + t2 and r["mask"][i] == [1] * len(t1) + [0] * len(result) + [1] * len(t2)
    assert "<|im_start|>tool\n84<|im_end|>" in tok.decode(result)
    assert r["scores"][i] == 1.0 and r["env_error"][i] is None and r["tool_calls"] == 0
    # max_tokens=1 cut the first turn of "asks" to its first id: the template ends the turn (loss_mask 0), the refused
    # n=2 was retried and the episode went on to its second turn
    i = by["asks"]
    t1, t2 = (t for _, t in sorted((k, t) for c, k, t, _ in r["made"] if c == "asks"))
    gap = TurnRenderer(tok, tools=CALCULATOR).appended_ids(
        [*r["messages"][i], {"role": "assistant", "content": "5"}], [{"role": "user", "content": "Go on."}],
        sampled_ids=t1[:1])
    assert tok.decode(gap).startswith("<|im_end|>") and len(t1) > 1
    assert r["ids"][i] == t1[:1] + gap + t2 and r["mask"][i] == [1] + [0] * len(gap) + [1] * len(t2)
    assert r["env_error"][i] is None and r["scores"][i] == 1.0
    assert r["wall"] < 15.0, r["wall"]  # three agents started and run at once: ~ one start
    print(f"rollout step with three agents: {r['wall']:.2f} s")


if __name__ == "__main__":
    main()
