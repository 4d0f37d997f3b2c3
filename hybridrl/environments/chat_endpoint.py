"""A local OpenAI-compatible chat-completions endpoint whose replies come from its owner, not from a model.

:class:`ChatEndpoint` serves, on ``127.0.0.1`` at a free port, from daemon threads (``ThreadingHTTPServer``):

- ``POST /v1/chat/completions``: the request is parsed and checked (below), handed to the owner of its API key as a
  :class:`ChatRequest`, and the HTTP request waits until the owner answers it (:meth:`ChatRequest.reply` with the
  assistant's message, or :meth:`ChatRequest.fail`); the answer is a ``chat.completion`` object, or with
  ``stream: true`` the same as server-sent ``chat.completion.chunk`` events (the role, the content, each tool call's
  id and name then its arguments, the finish reason; with ``stream_options.include_usage`` a last chunk with the
  usage; then ``[DONE]``), sent at once when the owner answers.
- ``GET /v1/models``: one model, ``policy``.

Each API key is a *session* (:meth:`ChatEndpoint.open_session`; a random key per session): ``Authorization: Bearer
<key>`` picks it, an unknown key is a 401. A session is one conversation, so it has at most one request waiting; a
second one meanwhile is a 400. Closing a session (or the endpoint) answers its waiting request with a 410.

What is supported: ``messages`` whose ``content`` is text (a string, or a list of ``{"type": "text"}`` parts, joined),
and function calling: ``tools`` (OpenAI function schemas, checked for shape here; whether they are the ones the
policy was shown is the owner's to check), ``tool_choice`` ``"auto"`` or ``"none"`` and ``parallel_tool_calls: true``
(:meth:`ChatRequest.reply` with ``tool_calls`` answers with ``message.tool_calls`` and ``finish_reason``
"tool_calls"). The fields that shape a reply are checked for type here and honoured by the owner: ``max_tokens``,
``max_completion_tokens``, ``stop``, ``logprobs``, ``temperature``, ``top_p``, ``seed`` (the owner refuses values
it cannot honour). ``model``, ``user``, ``metadata``, ``store`` and ``service_tier`` are accepted and change
nothing. Refused with a 400 that says so (:data:`REFUSED`): ``n > 1``, ``top_logprobs > 0``, a ``tool_choice`` that
forces a call, ``parallel_tool_calls: false``, penalties, ``logit_bias``, a ``response_format`` other than text, the
legacy ``functions`` / ``function_call``, and any other field (none is ignored silently).
Errors are OpenAI's shape, ``{"error": {"message", "type", "code"}}``, sent with ``x-should-retry: false``: each
one here is deterministic, so the ``openai`` client's automatic retries would only repeat it.

Messages reach the owner normalised (:func:`normalize`): ``role``, ``content`` as a string and any other key whose
value is not null, so that a message the client echoes back (``r.choices[0].message`` passed as is) compares equal
to the dict it came from. The endpoint knows nothing of episodes or policies (:mod:`.openai_agent` does).
"""

from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Message = dict[str, Any]
MODEL = "policy"
MAX_BODY_BYTES = 64 << 20
# field → why a request that sets it (to other than its neutral value) is refused
REFUSED: dict[str, str] = {
    "n": "one reply per request; the run samples actor_rollout_ref.rollout.n episodes per prompt, each its own agent",
    "top_logprobs": "the rollout engines return only the sampled token's log-prob (logprobs=true gives those)",
    "tool_choice": "'required' or a named function: the policy samples its turn freely and nothing can force a call; "
                   "use 'auto' (its calls come back as tool_calls) or 'none' (its turn comes back as text)",
    "parallel_tool_calls": "the policy may write several calls in a turn and each is trained on as sampled; leave "
                           "it unset or true and answer every call",
    "frequency_penalty": "a penalty changes the sampling distribution the trainer's importance ratio assumes",
    "presence_penalty": "a penalty changes the sampling distribution the trainer's importance ratio assumes",
    "logit_bias": "a bias changes the sampling distribution the trainer's importance ratio assumes",
    "response_format": "a structured format would constrain what the policy samples; only {'type': 'text'}",
    "functions": "deprecated by OpenAI: offer the functions as tools=[{'type': 'function', 'function': {...}}]",
    "function_call": "deprecated by OpenAI: use tools= and tool_choice=",
}
# the fields a request may set: shaped by the owner's reply, or changing nothing
FIELDS = frozenset({"model", "messages", "user", "metadata", "store", "service_tier", "stream", "stream_options",
                    "tools", "tool_choice", "parallel_tool_calls", "max_tokens", "max_completion_tokens", "stop",
                    "logprobs", "top_logprobs", "temperature", "top_p", "seed", "n", "frequency_penalty",
                    "presence_penalty", "logit_bias", "response_format", "functions", "function_call"})
_NEUTRAL: dict[str, Any] = {"n": 1, "top_logprobs": 0, "parallel_tool_calls": True, "frequency_penalty": 0,
                            "presence_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"}}


class RequestError(ValueError):
    """A request the endpoint does not serve: its HTTP status and OpenAI error type/code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.code = status, type, code


class ChatRequest:
    """One chat-completions request, waiting for its owner's answer (the first answer counts, later ones are
    ignored)."""

    def __init__(self, messages: list[Message], body: dict[str, Any]) -> None:
        self.messages, self.body = messages, body
        self._answered = threading.Event()
        self._lock = threading.Lock()
        self._answer: tuple[int, dict[str, Any]] | None = None

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The request's ``tools`` (function schemas), [] when it has none."""
        return list(self.body.get("tools") or [])

    @property
    def calls_allowed(self) -> bool:
        """The reply may carry ``tool_calls``: the request offers tools and ``tool_choice`` is not "none"."""
        return bool(self.tools) and self.body.get("tool_choice") != "none"

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def reply(self, message: Message, *, finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
              usage: dict[str, int] | None = None) -> None:
        """Answer with the assistant ``message`` (``role``, ``content`` and optional ``tool_calls``); finish_reason
        (default: "tool_calls" when it has calls, else "stop"), the choice's ``logprobs`` and the ``usage``."""
        finish = finish_reason or ("tool_calls" if message.get("tool_calls") else "stop")
        self._set(200, {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
                        "created": int(time.time()), "model": MODEL,
                        "choices": [{"index": 0, "message": dict(message), "finish_reason": finish,
                                     "logprobs": logprobs}], "usage": usage})

    def fail(self, error: RequestError) -> None:
        self._set(error.status, _error_body(error))

    @property
    def answered(self) -> bool:
        return self._answered.is_set()

    def _set(self, status: int, body: dict[str, Any]) -> None:
        with self._lock:
            if self._answer is None:
                self._answer = (status, body)
                self._answered.set()

    def _wait(self) -> tuple[int, dict[str, Any]]:
        self._answered.wait()
        assert self._answer is not None
        return self._answer


class _Session:
    def __init__(self, deliver: Callable[[ChatRequest], None], refused: Callable[[RequestError], None]) -> None:
        self.deliver, self.refused = deliver, refused
        self.waiting: ChatRequest | None = None


class ChatEndpoint:
    """The endpoint (module docstring); serving from construction until :meth:`shutdown`."""

    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _handler(self))
        self.port = int(self._server.server_address[1])
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        daemon=True, name="hybridrl-chat-endpoint")
        self._thread.start()
        self._closed = False

    def open_session(self, deliver: Callable[[ChatRequest], None],
                     refused: Callable[[RequestError], None] = lambda error: None) -> str:
        """A new API key; each request bearing it goes to ``deliver`` (called in the request's server thread), each
        one the endpoint refuses itself (a 400 here, never delivered) to ``refused``."""
        key = f"sk-hybridrl-{secrets.token_urlsafe(24)}"
        with self._lock:
            if self._closed:
                raise RuntimeError("the chat endpoint is shut down")
            self._sessions[key] = _Session(deliver, refused)
        return key

    def close_session(self, key: str) -> None:
        """Forget ``key``; its waiting request (if any) gets a 410."""
        with self._lock:
            session = self._sessions.pop(key, None)
        if session is not None and session.waiting is not None:
            session.waiting.fail(RequestError(410, "the episode of this API key has ended", type="episode_closed",
                                              code="episode_closed"))

    def shutdown(self) -> None:
        """Stop serving (idempotent); waiting requests get a 410."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            keys = list(self._sessions)
        for key in keys:
            self.close_session(key)
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    # ---- called by the request handler ----

    def _serve(self, method: str, path: str, headers: Any, read_body: Callable[[int], bytes]) -> tuple[int, Any]:
        route = path.split("?", 1)[0].rstrip("/")
        if route == "/v1/completions":  # legacy text completions: an episode's turns are the chat template's
            raise RequestError(404, f"{method} /v1/completions (legacy text completions) is not served: an episode is "
                                    "a conversation whose turns the policy's chat template renders token-exactly; "
                                    "send its messages to POST /v1/chat/completions", code="unknown_url")
        if route not in ("/v1/chat/completions", "/v1/models"):
            raise RequestError(404, f"no route {method} {route}: this endpoint serves POST /v1/chat/completions and "
                                    "GET /v1/models", code="unknown_url")
        key = str(headers.get("Authorization", "")).removeprefix("Bearer ").strip()
        with self._lock:
            session = self._sessions.get(key)
        if session is None:
            raise RequestError(401, "unknown API key: use the episode's OPENAI_API_KEY", type="authentication_error",
                               code="invalid_api_key")
        if route == "/v1/models":
            if method != "GET":
                raise RequestError(405, f"{method} /v1/models: use GET", code="method_not_allowed")
            return 200, {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                     "owned_by": "hybridrl"}]}
        if method != "POST":
            raise RequestError(405, f"{method} /v1/chat/completions: use POST", code="method_not_allowed")
        try:
            request = ChatRequest(*_parse(headers, read_body))
        except RequestError as e:
            session.refused(e)
            raise
        with self._lock:
            if session.waiting is not None:
                raise RequestError(400, "this episode already has a request waiting for its reply: an episode is "
                                        "one conversation, ask one request at a time", code="concurrent_request")
            if key not in self._sessions:  # closed meanwhile
                raise RequestError(410, "the episode of this API key has ended", type="episode_closed",
                                   code="episode_closed")
            session.waiting = request
        try:
            session.deliver(request)
            status, answer = request._wait()
            if status == 200 and request.stream:
                return status, _SSE(_chunks(answer, usage=bool((request.body.get("stream_options") or {}).get(
                    "include_usage"))))
            return status, answer
        finally:
            with self._lock:
                session.waiting = None


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a request waiting for its reply never holds up the process's exit

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client gone mid-request is no news
            super().handle_error(request, client_address)


def normalize(message: Any) -> Message:
    """A request's message as the owner sees it (module docstring); RequestError if it is not a text message."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(400, f"each message is an object with a string 'role'; got {_short(message)}",
                           code="invalid_message")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise RequestError(400, f"only text content is supported (a string or {{'type': 'text'}} parts); got "
                                    f"{_short(content)}", code="unsupported_content")
        content = "".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise RequestError(400, f"content is a string or a list of text parts; got {_short(content)}",
                           code="unsupported_content")
    out = {k: v for k, v in message.items() if v is not None and k not in ("role", "content")}
    return {"role": message["role"], "content": content, **out}


def _parse(headers: Any, read_body: Callable[[int], bytes]) -> tuple[list[Message], dict[str, Any]]:
    try:
        length = int(headers.get("Content-Length", ""))
    except ValueError:
        raise RequestError(411, "a request body with a Content-Length header is required") from None
    if length > MAX_BODY_BYTES:
        raise RequestError(413, f"the request body ({length} bytes) is over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(read_body(length))
    except ValueError as e:
        raise RequestError(400, f"the request body is not JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body is a JSON object", code="invalid_json")
    _check_fields(body)
    _check_tools(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages is a non-empty list of chat messages", code="invalid_messages")
    return [normalize(m) for m in messages], body


def _check_fields(body: dict[str, Any]) -> None:
    if unknown := sorted(set(body) - FIELDS):
        raise RequestError(400, f"{', '.join(unknown)} not supported by this endpoint (it serves the rollout's policy; "
                                f"a field it cannot honour is refused, never ignored)", code="unsupported_parameter")
    for name, why in REFUSED.items():
        value = body.get(name)
        if value is not None and value != _NEUTRAL.get(name) and name not in ("tool_choice",):
            raise RequestError(400, f"{name}={json.dumps(value)[:200]} not supported: {why}",
                               code="unsupported_parameter")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RequestError(400, f"{name}={_short(value)}: an integer ≥ 1", code="invalid_value")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) and stop or isinstance(stop, list) and all(
            isinstance(x, str) and x for x in stop)):
        raise RequestError(400, f"stop={_short(stop)}: a non-empty string or a list of them", code="invalid_value")
    for name in ("temperature", "top_p", "seed"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise RequestError(400, f"{name}={_short(value)}: a number", code="invalid_value")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise RequestError(400, "stream_options is only for stream=true", code="invalid_value")


def _check_tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise RequestError(400, f"tools is a list of {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                                f"...}}}}; got {_short(tools)}", code="invalid_tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError(400, f"tool_choice={_short(choice)} not supported: {REFUSED['tool_choice']}",
                           code="unsupported_parameter")


class _SSE(bytes):
    """A streamed answer: server-sent events, sent whole."""


def _chunks(completion: dict[str, Any], *, usage: bool) -> bytes:
    """``completion`` as the ``chat.completion.chunk`` events a streaming OpenAI server sends."""
    (choice,) = completion["choices"]
    message, logprobs = choice["message"], choice["logprobs"]
    head = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def delta(d: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": d, "logprobs": lp, "finish_reason": finish}],
                **({"usage": None} if usage else {})}

    events = [delta({"role": "assistant", "content": ""})]
    if message.get("content"):
        events.append(delta({"content": message["content"]}, lp=logprobs))
    for i, call in enumerate(message.get("tool_calls") or []):
        events.append(delta({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                             "function": {"name": call["function"]["name"], "arguments": ""}}]}))
        events.append(delta({"tool_calls": [{"index": i, "function": {"arguments": call["function"]["arguments"]}}]}))
    events.append(delta({}, finish=choice["finish_reason"]))
    if usage:
        events.append({**head, "choices": [], "usage": completion.get("usage")})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def _error_body(error: RequestError) -> dict[str, Any]:
    return {"error": {"message": str(error), "type": error.type, "code": error.code}}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "…"


def _handler(endpoint: ChatEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connection
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK wait between them

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def _answer(self, method: str) -> None:
            try:
                status, body = endpoint._serve(method, self.path, self.headers, self.rfile.read)
            except RequestError as e:
                status, body = e.status, _error_body(e)
            streamed = isinstance(body, _SSE)
            data = bytes(body) if streamed else json.dumps(body).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if streamed else "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status != 200:  # and the body may be unread: no keep-alive after an error
                    self.send_header("x-should-retry", "false")
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client is gone (an agent killed while it waited)
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:  # no access log on stderr
            pass

    return Handler
