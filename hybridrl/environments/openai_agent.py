"""``openai_agent``: an agent program written elsewhere — plain ``openai`` client code — drives each episode.

The agent is any program (``Config.command``) that talks to the policy through the OpenAI chat-completions API::

    import json, os
    from openai import OpenAI

    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY are the episode's
    messages = json.loads(os.environ["HYBRIDRL_TASK"])  # the prompt's chat messages
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Are you sure?"}]
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    print(json.dumps({"reward": float("5" in reply)}))  # optional: the episode's reward, as the last stdout line

Each rank that owns episodes runs one endpoint (:mod:`.chat_endpoint`, on 127.0.0.1, started at the first ``open``,
shut down by :meth:`OpenAIAgent.close`, when the environment is garbage-collected, or at exit). ``open`` starts the
agent with ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (a random key per episode: it picks the episode),
``HYBRIDRL_TASK`` (JSON of ``SampleMeta.messages``), the task's data — ``HYBRIDRL_GROUND_TRUTH`` (the row's
``data.ground_truth_key``; empty if none), ``HYBRIDRL_DATA_SOURCE`` and ``HYBRIDRL_EXTRA`` (JSON of the row's other
non-prompt fields, ``SampleMeta.extra``; a value JSON cannot hold is its ``str``) — ``HYBRIDRL_SEED`` and
``Config.env`` on top of this process's environment (with ``127.0.0.1`` added to ``NO_PROXY``, so a cluster's HTTP
proxy does not swallow the requests), in a session of its own, so that it is killed with its children; stdin is
empty, stdout and stderr are kept (their last 64 KiB).

The episode runs in lock-step with the rollout, which has generated the policy's first turn from the prompt before
the first ``step``:

- ``step(turn)`` waits for the agent's waiting request and answers it with the turn's text (a ``chat.completion``
  with ``finish_reason`` "stop"), then waits for what the agent does next.
- Its next request must send the conversation so far — the first request exactly the task's messages, each later
  one everything it sent before plus the reply as the endpoint returned it — followed by new non-assistant
  messages: those are the step's ``EnvStep.messages`` (``done=False``), rendered by the chat template before the
  policy's next turn.
- Its exit with code 0 ends the episode (``done=True``); its reward is the last stdout line when that is JSON
  ``{"reward": <number>}``, else None.

Token-exact: the agent only ever sees text, and nothing it sees is trained on. The rollout builds the sample from the
engine's own ids and log-probs of each policy turn (``loss_mask`` 1) and the chat template's ids of the agent's
messages (``loss_mask`` 0) (:mod:`hybridrl.rollout.turns`), so an episode driven from outside trains exactly as a
built-in environment's does. For the same reason the agent may not put words in the policy's mouth: a request whose
history differs from what the endpoint returned (a rewritten or dropped turn, a system prompt of its own), or whose
new messages include an ``assistant`` one, is answered with a 400.

Every 400 leaves the episode as it was: the agent may send another request (an agent that exits over one fails the
episode, and the error names the refusal). The request's fields are honoured from the turn's tokens
(:mod:`.agent_replies`; ``step_turn``, :class:`~hybridrl.interfaces.PolicyTurn`, which the rollout calls):
``max_tokens`` / ``max_completion_tokens`` and ``stop`` cut the turn (``EnvStep.keep_tokens``: the sample keeps the
sampled ids up to the cut), ``logprobs`` gives the engine's, ``usage`` counts the context and the kept ids;
``temperature``, ``top_p`` and ``seed`` other than the run's are refused, naming the config key (the trainer's
importance ratio assumes the run's sampling). ``step`` (the turn's text alone, outside a rollout) refuses those
fields.

Function calling: the agent's own tools (its requests' ``tools=``) are ``Config.tools``, which the chat template
renders into every prompt (:func:`hybridrl.rollout.episodes.tool_schemas`) before the agent asks; a request that
offers other tools is refused, naming the key. A turn that calls one of them goes to the agent whole: its Hermes
``<tool_call>`` blocks come back as ``message.tool_calls`` (ids ``call_…``, JSON-string arguments, ``finish_reason``
"tool_calls", the rest of the text as ``content``), and the agent's ``{"role": "tool", "tool_call_id", "content"}``
messages are the step's messages, rendered by the template (``loss_mask`` 0) like any other. A turn with a call that
cannot be read, or any turn of a request with ``tool_choice="none"`` or no ``tools``, comes back as text. A turn
whose calls all name ``multi_turn.tools`` is run by the rollout and never reaches the agent. What else the endpoint
supports is in :mod:`.chat_endpoint`.

Faults, each failing the episode (the step raises; the rollout applies ``reward.on_error``) and killing the agent:
a non-zero exit (the error names the code, the last refusal if any, and ends with the stderr tail), an exit before
the first request is answered, and ``Config.timeout_s`` (the agent's whole life, from ``open``) running out. The
rollout's ``multi_turn.environment_timeout_s`` bounds each ``step`` as well, and a step lasts from the reply to the
agent's next request: an agent that works long between requests needs it raised.
``close()`` — the rollout's, whenever the episode ends, also early on the response budget or
``max_assistant_turns`` — kills the agent's process group and answers its waiting request with a 410. An agent that
leaves its session (``setsid``) escapes the kill; one whose trainer is SIGKILLed (no exit hook runs) lives on until
its request fails: the connection drops with the trainer and the ``openai`` client's retries are refused.
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import IO, Any

from hybridrl.batch import SampleMeta
from hybridrl.environments.agent_replies import answer, same, sampling_problem
from hybridrl.environments.chat_endpoint import ChatEndpoint, ChatRequest, Message, RequestError, normalize
from hybridrl.interfaces import EnvStep, PolicyTurn
from hybridrl.tools.config import KEY

_RESERVED = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "HYBRIDRL_TASK", "HYBRIDRL_GROUND_TRUTH", "HYBRIDRL_DATA_SOURCE",
             "HYBRIDRL_EXTRA", "HYBRIDRL_SEED")
TAIL_BYTES = 64 << 10  # of the agent's stdout and of its stderr


class AgentError(RuntimeError):
    """The agent failed, or ran out of time; ``kind`` names how (``agent_start``, ``agent_exited``,
    ``agent_refused``: it exited after a request was refused, ``agent_timeout``, ``agent_reward``, ``agent_closed``),
    the rollout's count of failed episodes by kind (``multi_turn/env_errors/<kind>``)."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class OpenAIAgent:
    """``openai_agent`` environment (module docstring)."""

    @dataclass(slots=True, kw_only=True)
    class Config:
        # the agent program's argv, e.g. ["python", "agent.py"]; a first word "python" is this interpreter
        # (sys.executable), so the agent sees the trainer's packages wherever PATH points
        command: list[str]
        env: dict[str, str] = field(default_factory=dict)  # extra environment variables of the agent
        timeout_s: float = 300.0  # the agent's whole life (from open); past it it is killed and the episode fails
        # the tools the agent offers (its requests' ``tools=``: OpenAI function schemas, e.g. a JSON file's list);
        # the chat template renders them into every prompt, as a serving engine renders a request's tools
        tools: list[dict[str, Any]] = field(default_factory=list)

        def __post_init__(self) -> None:
            if not isinstance(self.command, list | tuple) or not self.command or not all(
                    isinstance(a, str) and a for a in self.command):
                raise ValueError(f"command={self.command!r} must be a non-empty list of non-empty strings: the agent "
                                 "program's argv, e.g. ['python', 'agent.py']")
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
                raise ValueError(f"env={self.env!r} must map names to string values")
            if reserved := [k for k in self.env if k in _RESERVED]:
                raise ValueError(f"env sets {reserved}, which openai_agent sets itself for each episode")
            if not self.timeout_s > 0:
                raise ValueError(f"timeout_s={self.timeout_s} must be > 0 (seconds)")
            if not isinstance(self.tools, list | tuple) or not all(
                    isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                    and isinstance(t["function"].get("name"), str) for t in self.tools):
                raise ValueError(f"tools={_short(self.tools)} must be a list of OpenAI function schemas "
                                 "{'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
            self.tools = [json.loads(json.dumps(t)) for t in self.tools]  # plain JSON (a recipe's config nodes)

    def __init__(self, config: OpenAIAgent.Config | None = None, **ctx: Any) -> None:
        self.config = config if config is not None else self.Config()  # type: ignore[call-arg]  # names command
        self._endpoint: ChatEndpoint | None = None
        self._episodes: weakref.WeakSet[AgentEpisode] = weakref.WeakSet()
        self.tools = self.config.tools  # rendered into the prompts (hybridrl.rollout.episodes.tool_schemas)

    def open(self, meta: SampleMeta, *, seed: int) -> AgentEpisode:
        if meta.messages is None:
            raise ValueError("openai_agent needs the prompt's chat messages (SampleMeta.messages): the agent's first "
                             "request sends them; use a chat-templated dataset (data.apply_chat_template=true)")
        if self._endpoint is None:
            self._endpoint = ChatEndpoint()
            weakref.finalize(self, self._endpoint.shutdown)  # at garbage collection or exit
        episode = AgentEpisode(self.config, self._endpoint, [normalize(m) for m in meta.messages], seed=seed,
                               data=task_data(meta))
        self._episodes.add(episode)
        return episode

    def close(self) -> None:
        """Kill every open episode's agent and shut the endpoint down."""
        for episode in list(self._episodes):
            episode.close()
        if self._endpoint is not None:
            self._endpoint.shutdown()
            self._endpoint = None


_CLOSED = object()  # in an episode's event queue: close() was called


@dataclass(slots=True, frozen=True)
class _Exited:
    code: int


class AgentEpisode:
    """One episode: the agent's process and its conversation (module docstring)."""

    def __init__(self, config: OpenAIAgent.Config, endpoint: ChatEndpoint, task: list[Message], *, seed: int,
                 data: dict[str, str] | None = None) -> None:
        self.config, self.endpoint = config, endpoint
        self.history = list(task)  # the conversation as the agent has it: what its next request must start with
        self._first = True
        self.seed = seed
        self._refused = ""  # why the agent's latest request was refused, until one is answered
        self._waiting: ChatRequest | None = None  # the agent's request the next step answers
        self._events: queue.Queue[Any] = queue.Queue()  # ChatRequest, _Exited, _CLOSED
        self._closed = False
        self._lock = threading.Lock()
        self.key = endpoint.open_session(self._events.put, self._on_refused)
        argv = [sys.executable if config.command[0] == "python" else config.command[0], *config.command[1:]]
        no_proxy = ",".join(p for p in (os.environ.get("NO_PROXY", os.environ.get("no_proxy", "")),
                                        "127.0.0.1", "localhost") if p)
        env = {**os.environ, **config.env, "OPENAI_BASE_URL": endpoint.base_url, "OPENAI_API_KEY": self.key,
               "HYBRIDRL_TASK": json.dumps(task), **(data or {}), "HYBRIDRL_SEED": str(seed), "NO_PROXY": no_proxy,
               "no_proxy": no_proxy}
        self.deadline = time.monotonic() + config.timeout_s
        try:
            self.agent = _Agent(argv, env, self._events)
        except OSError as e:
            endpoint.close_session(self.key)
            raise AgentError(f"openai_agent could not start command={config.command!r}: {e}",
                             kind="agent_start") from e
        weakref.finalize(self, self.agent.kill)  # at exit, or an episode dropped without close()

    def step(self, message: dict[str, Any]) -> EnvStep:
        """Answer with the turn as text alone (outside a rollout): a request that needs its tokens is refused."""
        return self._guarded(str(message["content"]))

    def step_turn(self, turn: PolicyTurn) -> EnvStep:
        """Answer with the turn and its tokens (the rollout's call): max_tokens, stop, logprobs, usage."""
        return self._guarded(turn)

    def _guarded(self, turn: PolicyTurn | str) -> EnvStep:
        try:
            return self._step(turn)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill the agent (and its children) and end its session; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.agent.kill()
        self.endpoint.close_session(self.key)  # its waiting request gets a 410
        self._events.put(_CLOSED)
        self.agent.join()

    def _step(self, turn: PolicyTurn | str) -> EnvStep:
        if self._waiting is None:  # the first step: the agent's first request
            event = self._request(turn)
            if isinstance(event, _Exited):
                when = (f"after its first request was refused with a 400 ({self._refused})" if self._refused
                        else "before its first request")
                raise AgentError(f"the agent {self._ended(event)} {when}{self.agent.stderr_tail()}",
                                 kind="agent_refused" if self._refused else "agent_exited")
            self._waiting = event[0]
        message, keep, fields = answer(self._waiting, turn)
        self._waiting.reply(message, **fields)
        self._waiting = None
        self.history.append(normalize(message))
        event = self._request(turn)
        if isinstance(event, _Exited):
            if event.code != 0:
                refused = f" after its request was refused with a 400 ({self._refused})" if self._refused else ""
                raise AgentError(f"the agent {self._ended(event)}{refused}{self.agent.stderr_tail()}",
                                 kind="agent_refused" if self._refused else "agent_exited")
            return EnvStep(messages=[], done=True, reward=_reward(self.agent.stdout.text()),
                           info={"returncode": 0}, keep_tokens=keep)
        self._waiting, new = event
        self.history += new
        return EnvStep(messages=[dict(m) for m in new], done=False, keep_tokens=keep)

    def _request(self, turn: PolicyTurn | str) -> tuple[ChatRequest, list[Message]] | _Exited:
        """The agent's next request that may be answered, with its new messages, or its exit; a request that may
        not is answered with a 400 and the agent may send another (the episode goes on)."""
        while True:
            event = self._next()
            if isinstance(event, _Exited):
                return event
            accepted = self._accept(event, turn)
            if not isinstance(accepted, str):
                self._refused = ""
                return event, accepted
            event.fail(RequestError(400, f"hybridrl: {accepted}", code="unsupported_request"))
            self._refused = accepted

    def _on_refused(self, error: RequestError) -> None:
        """The endpoint refused a request of this episode's agent itself (its fields): remembered for the error
        message should the agent exit over it."""
        self._refused = str(error)

    def _next(self) -> ChatRequest | _Exited:
        """The agent's next request or its exit, within its time limit."""
        try:
            event = self._events.get(timeout=max(self.deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise AgentError(f"the agent ran past timeout_s={self.config.timeout_s:g} s (its whole episode) and was "
                             "killed", kind="agent_timeout") from None
        if event is _CLOSED:
            raise AgentError("the episode was closed", kind="agent_closed")
        return event  # type: ignore[no-any-return]

    def _accept(self, request: ChatRequest, turn: PolicyTurn | str) -> list[Message] | str:
        """The new messages of ``request`` after the conversation so far, or why it may not be answered."""
        sent, h, first = request.messages, self.history, self._first
        if len(sent) < len(h) or not all(map(same, sent, h)):
            i = next((i for i, (a, b) in enumerate(zip(sent, h, strict=False)) if not same(a, b)),
                     min(len(sent), len(h)))
            what = "the task's messages (HYBRIDRL_TASK)" if first else "the conversation so far"
            return (f"its messages do not start with {what}: message {i} is "
                    f"{_short(sent[i]) if i < len(sent) else 'missing'}, the conversation has "
                    f"{_short(h[i]) if i < len(h) else 'no message there'}; an agent may only add messages after "
                    "the replies it got, never rewrite them (the sample trains on the policy's own tokens)")
        new = sent[len(h):]
        if first and new:
            return (f"the first request must send exactly the task's messages (HYBRIDRL_TASK), from which the "
                    f"policy's first turn was generated; it adds {len(new)} more")
        if not first and not new:
            return "it sends no new message after the policy's reply (add the next user or tool message)"
        if bad := [m for m in new if m["role"] == "assistant"]:
            return (f"it sends an assistant message of its own ({_short(bad[0])}): every assistant turn is the "
                    "policy's, sampled by the rollout")
        if bad := [m for m in new if not isinstance(m["content"], str)]:
            return f"a new message has no text content: {_short(bad[0])}"
        if request.tools and _canonical(request.tools) != _canonical(self.config.tools):
            return (f"its tools {_short(_names(request.tools))} are not the ones the policy's prompt shows: "
                    f"{KEY}.environment_kwargs.tools={_short(_names(self.config.tools))} (the chat template renders "
                    "them into the prompt before the agent asks; set that key to the agent's tools=, as JSON)")
        if problem := sampling_problem(request.body, turn, seed=self.seed):
            return problem
        self._first = False
        return new

    def _ended(self, event: _Exited) -> str:
        if event.code < 0:
            return f"was killed by {signal.Signals(-event.code).name}"
        return f"exited with code {event.code}"


class _Agent:
    """The agent's process, in a session of its own; its exit goes to ``events`` once its output is read."""

    def __init__(self, argv: list[str], env: dict[str, str], events: queue.Queue[Any]) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.stdout, self.stderr = _Tail(self.proc.stdout), _Tail(self.proc.stderr)  # type: ignore[arg-type]
        self._lock = threading.Lock()
        self._reaped = False
        self._waiter = threading.Thread(target=self._wait, args=(events,), daemon=True, name="hybridrl-agent-wait")
        self._waiter.start()

    def kill(self) -> None:
        """SIGKILL the agent's process group (its children too), unless it is reaped (its pid may be reused)."""
        with self._lock:
            if not self._reaped:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def join(self) -> None:
        self._waiter.join(timeout=10.0)

    def stderr_tail(self, chars: int = 2000) -> str:
        text = self.stderr.text().rstrip()
        return f"; its stderr ends:\n{text[-chars:]}" if text else " (no stderr)"

    def _wait(self, events: queue.Queue[Any]) -> None:
        try:  # exited but not yet reaped: its pid, the group's id, cannot be reused while the group is killed
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        self.kill()  # what it left running in its group
        self.stdout.join()
        self.stderr.join()
        with self._lock:
            code = self.proc.wait()
            self._reaped = True
        events.put(_Exited(code))


class _Tail:
    """The last ``TAIL_BYTES`` of a pipe, read to its end by a thread."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self._buf = bytearray()
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True, name="hybridrl-agent-output")
        self._thread.start()

    def _read(self, pipe: IO[bytes]) -> None:
        with pipe:
            while chunk := os.read(pipe.fileno(), 1 << 16):
                self._buf += chunk
                del self._buf[:-TAIL_BYTES]

    def join(self) -> None:
        self._thread.join(timeout=2.0)  # a child that escaped the group may hold the pipe open

    def text(self) -> str:
        return bytes(self._buf).decode(errors="replace")


def _reward(stdout: str) -> float | None:
    """The reward of the last stdout line ``{"reward": <number>}``; None when that line is something else."""
    lines = stdout.strip().splitlines()
    try:
        last = json.loads(lines[-1]) if lines else None
    except ValueError:
        return None
    if not isinstance(last, dict) or "reward" not in last:
        return None
    r = last["reward"]
    if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r):
        raise AgentError(f"the agent's last stdout line {lines[-1][:200]!r} gives a reward that is not a finite number",
                         kind="agent_reward")
    return float(r)


def task_data(meta: SampleMeta) -> dict[str, str]:
    """The row's data as the agent's environment variables (module docstring)."""
    return {"HYBRIDRL_GROUND_TRUTH": "" if meta.ground_truth is None else str(meta.ground_truth),
            "HYBRIDRL_DATA_SOURCE": meta.data_source, "HYBRIDRL_EXTRA": json.dumps(dict(meta.extra), default=str)}


def _canonical(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, sort_keys=True)


def _names(tools: list[dict[str, Any]]) -> list[str]:
    return [str(t.get("function", {}).get("name")) for t in tools]


def _short(message: Any) -> str:
    text = repr(message)
    return text if len(text) <= 160 else text[:160] + "…"
