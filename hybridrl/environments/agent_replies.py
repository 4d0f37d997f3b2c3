"""What the policy's turn becomes for an agent's chat-completions request (:mod:`.openai_agent`), and which of a
request's sampling fields can be honoured.

:func:`answer` makes the reply from the turn's tokens (:class:`~hybridrl.interfaces.PolicyTurn`): ``stop`` and
``max_tokens`` / ``max_completion_tokens`` cut it (how many of its sampled ids the sample keeps), ``logprobs`` are
the engine's, ``usage`` counts the context and the kept ids, and its Hermes ``<tool_call>`` blocks become OpenAI
``tool_calls`` where the request allows calls (:func:`reply`). :func:`sampling_problem` says why a request's
``temperature``, ``top_p`` or ``seed`` cannot be honoured: the turns were sampled with the run's settings, which the
trainer's importance ratio assumes.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Any

from hybridrl.environments.chat_endpoint import ChatRequest, Message
from hybridrl.interfaces import PolicyTurn
from hybridrl.tools.calls import CallError, ToolCall, parse_calls

_CALL_BLOCKS = re.compile(r"<tool_call>.*?</tool_call>", re.S)
_SAMPLING = ("temperature", "top_p", "seed")  # checked against the run's
_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "stop", "logprobs")  # honoured from the turn's tokens


def sampling_problem(body: dict[str, Any], turn: PolicyTurn | str, *, seed: int) -> str:
    """Why the sampling fields of a request cannot be honoured ("" when they can): the policy's turn was sampled
    with the run's settings, which the trainer's importance ratio assumes."""
    if isinstance(turn, str):
        if used := [f for f in (*_SAMPLING, *_TOKEN_FIELDS) if body.get(f) not in (None, False)]:
            return (f"{', '.join(used)} need the policy's tokens and sampling settings, which an episode stepped "
                    "outside a rollout (step(), not step_turn()) does not have")
        return ""
    run = {"temperature": turn.params.temperature, "top_p": turn.params.top_p}
    for name, value in run.items():
        asked = body.get(name)
        if asked is not None and not math.isclose(asked, value, abs_tol=1e-6):
            return (f"{name}={asked:g} differs from the run's {value:g}, which sampled the policy's turns and which "
                    f"the trainer's importance ratio assumes: it is set by actor_rollout_ref.rollout.{name} "
                    f"(val_kwargs.{name} in validation); leave {name} unset or send {value:g}")
    if body.get("seed") is not None and body["seed"] != seed:
        return (f"seed={body['seed']} differs from this episode's seed {seed} (HYBRIDRL_SEED, derived from "
                "trainer.seed: the run seeds each episode's turns itself); leave seed unset or send HYBRIDRL_SEED")
    return ""


def answer(request: ChatRequest, turn: PolicyTurn | str) -> tuple[Message, int | None, dict[str, Any]]:
    """The reply to ``request`` from the policy's ``turn``: (message, how many of the turn's ids the sample keeps
    (None: all), the reply's finish_reason, logprobs and usage). ``stop`` cuts the turn after the token that
    completes a stop string (the reply's content ends before it), ``max_tokens`` / ``max_completion_tokens`` after
    that many sampled ids (finish_reason "length"); the sample keeps the ids up to the cut, as sampled."""
    if isinstance(turn, str):
        return reply(turn, calls=request.calls_allowed), None, {}
    body, ids = request.body, turn.token_ids
    ended = bool(ids) and ids[-1] == turn.eos_token_id
    content = ids[:-1] if ended else ids
    keep, text, finish = None, turn.text, "stop" if ended else "length"
    stops = [body["stop"]] if isinstance(body.get("stop"), str) else list(body.get("stop") or [])
    if any(x in text for x in stops):  # the first id whose text completes a stop string
        k = next(k for k in range(1, len(content) + 1) if any(x in turn.decode(content[:k]) for x in stops))
        prefix = turn.decode(content[:k])
        keep, text, finish = k, prefix[:min(prefix.index(x) for x in stops if x in prefix)], "stop"
    limits = [v for v in (body.get("max_tokens"), body.get("max_completion_tokens")) if v is not None]
    if limits and min(limits) < (len(ids) if keep is None else keep):
        keep, finish = min(limits), "length"
        text = turn.decode(ids[:keep])
    kept = ids if keep is None else ids[:keep]
    message = reply(text, calls=request.calls_allowed)
    if finish == "stop" and message.get("tool_calls"):
        finish = "tool_calls"
    shown = kept[:-1] if kept and kept[-1] == turn.eos_token_id else kept
    logprobs = None
    if body.get("logprobs"):
        tokens = [turn.decode([i]) for i in shown]
        logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in zip(tokens, turn.logprobs, strict=False)], "refusal": None}
    usage = {"prompt_tokens": turn.context_tokens, "completion_tokens": len(kept),
             "total_tokens": turn.context_tokens + len(kept)}
    return message, keep, {"finish_reason": finish, "logprobs": logprobs, "usage": usage}


def reply(text: str, *, calls: bool) -> Message:
    """The policy's turn as an assistant message: with ``calls``, its Hermes tool calls as OpenAI ``tool_calls``
    (JSON-string arguments) and the rest of the text as ``content`` (None if empty); a turn with a call that cannot
    be read is text as a whole, as is every turn without ``calls``."""
    parsed = parse_calls(text) if calls else []
    if not parsed or any(isinstance(c, CallError) for c in parsed):
        return {"role": "assistant", "content": text}
    rest = _CALL_BLOCKS.sub("", text).strip()
    return {"role": "assistant", "content": rest or None,
            "tool_calls": [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for c in parsed if isinstance(c, ToolCall)]}


def same(sent: Message, had: Message) -> bool:
    """``sent`` is the message ``had`` as an agent may echo it: no content and empty content alike."""
    def plain(m: Message) -> Message:
        return {**m, "content": m.get("content") or ""}
    return plain(sent) == plain(had)
