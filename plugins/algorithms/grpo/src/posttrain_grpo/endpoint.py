"""An OpenAI-compatible chat-completions endpoint on the policy's generation engines.

Agents written outside posttrain (any harness that speaks the OpenAI API) roll out against
the policy being trained: each episode gets a *session* with a ``base_url`` of its own
(``http://HOST:PORT/sessions/<id>/v1``), and the agent calls ``POST {base_url}/chat/completions``
as with any OpenAI-compatible server (``GET {base_url}/models`` lists the one model). The
endpoint keeps, per session, the exact token sequence the engines saw and sampled:

- the first request's messages (and ``tools``) are rendered with the chat template, as the
  rollout renders a prompt;
- a later request must repeat the session's conversation so far (the messages sent and the
  assistant messages received, tool calls by their ids) and may add messages (tool
  results, a user's reply); only the added messages are rendered, as the tokens between
  the last generation and the next (:meth:`~posttrain.run.rollout.ChatFormat.bridge_ids`),
  so the sampled tokens are never decoded and encoded again;
- each completion is sampled by the generation backend (requests of all sessions that
  arrive within ``batch_window_s`` of each other go to the engines as one batch), with
  the run's sampling settings (``generation.*``; a request's ``temperature``, ``top_p``
  and ``seed`` are ignored; ``max_tokens`` lowers the budget, ``stop`` adds stop strings).

A response is a standard ``chat.completion``: ``content``, and ``tool_calls`` parsed from the
text in ``tool_call_format`` (a call that cannot be read stays text), ``finish_reason``
``stop``, ``tool_calls`` or ``length``, ``logprobs`` when asked for, ``usage``. Each choice
also carries ``token_ids`` (the sampled ids) and ``prompt_token_ids`` (what the engine was
given), as vLLM's server does when asked, so an agent can check what was trained.

Errors are JSON ``{"error": {"message", "type", "code"}}``: 404 for an unknown session or
path, 410 for a session that has ended (its rollout finished, or it passed its deadline),
400 for a request that is not JSON, does not repeat the conversation, or changes the tools.

The driver's thread serves it; the engines do the work. ``host`` ``0.0.0.0`` serves agents
on other machines of the cluster; the base URL then names this node's address.
"""

from __future__ import annotations

import http.server
import json
import queue
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import attrs

from posttrain.batch import Batch
from posttrain.data.tool_calls import FORMATS, MalformedToolCall, text_around_calls
from posttrain.interfaces import Generation, Message
from posttrain.log import get_logger
from posttrain.run.rollout import ChatFormat, Conversation, generation_batch

_log = get_logger(__name__)


class EndpointError(Exception):
    """A request the endpoint refuses: HTTP ``status``, OpenAI error ``kind``."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind


@attrs.define(eq=False)
class Session:
    """One episode of one agent: its conversation as the engines saw it, and as the agent sees it."""

    id: str
    greedy: bool
    conversation: Conversation | None = None
    history: list[tuple[Any, ...]] = attrs.field(factory=list)  # the agent's messages, canonical (see _canonical)
    requests: int = 0
    ended: str | None = None  # why it ended; None while open
    lock: threading.Lock = attrs.field(factory=threading.Lock)


class ChatEndpoint:
    """The HTTP server and its sessions (see the module docstring).

    ``max_total_length`` caps a session's tokens (``policy.max_total_sequence_length``);
    ``tool_call_format`` is ``hermes``, ``llama3_json`` or None (tool calls stay text).
    """

    def __init__(
        self,
        generation: Generation,
        tokenizer: Any,
        *,
        chat_template: str | None,
        max_total_length: int,
        tool_call_format: str | None = "hermes",
        host: str = "127.0.0.1",
        port: int = 0,
        batch_window_s: float = 0.005,
        model_name: str = "posttrain-policy",
    ):
        self.chat = ChatFormat(tokenizer, chat_template)
        self.max_total_length = max_total_length
        self.tool_call_format = tool_call_format
        self.model_name = model_name
        self._sessions: dict[str, Session] = {}
        self._batcher = _Batcher(generation, self.chat.pad_token_id, batch_window_s)
        self._server = http.server.ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        address = socket.gethostbyname(socket.gethostname()) if host == "0.0.0.0" else host
        self.address = f"http://{address}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="posttrain-endpoint", daemon=True)
        self._thread.start()

    def open(self, *, greedy: bool = False) -> Session:
        """A new session (greedy decoding, for validation, or sampling)."""
        session = Session(secrets.token_hex(8), greedy)
        self._sessions[session.id] = session
        return session

    def base_url(self, session: Session) -> str:
        """What the agent of ``session`` gives its OpenAI client as ``base_url``."""
        return f"{self.address}/sessions/{session.id}/v1"

    def end(self, session: Session, reason: str) -> None:
        """End ``session``: later requests get HTTP 410 with ``reason``. A request being
        served finishes first."""
        with session.lock:
            session.ended = reason

    def shutdown(self) -> None:
        """Stop serving and the batcher. Safe to call twice."""
        self._server.shutdown()
        self._server.server_close()
        self._batcher.stop()

    # ------------------------------------------------------------------ requests

    def complete(self, session_id: str, request: Mapping[str, Any]) -> dict[str, Any]:
        """Serve one chat-completions request of a session (raises :class:`EndpointError`)."""
        session = self._sessions.get(session_id)
        if session is None:
            raise EndpointError(404, "not_found_error", f"no session '{session_id}' on this endpoint")
        with session.lock:
            if session.ended is not None:
                raise EndpointError(410, "session_ended", f"session '{session_id}' has ended: {session.ended}")
            messages = request.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
                raise EndpointError(400, "invalid_request_error", "'messages' must be a non-empty list of message objects")
            conversation = self._extend(session, messages, request.get("tools") or [])
            if not self._room(conversation):
                return self._response(session, conversation, [], request, finish="length")
            outputs, row = self._batcher.generate(conversation, session.greedy, _stop_strings(request))
            start = len(conversation.token_ids)
            conversation.add_assistant_turn(outputs, row, self.chat, self.max_total_length)
            sampled = conversation.token_ids[start:]
            budget = request.get("max_tokens") or request.get("max_completion_tokens")
            finish = "length" if conversation.truncated else "stop"
            if isinstance(budget, int) and 0 < budget < len(sampled):
                self._cut(conversation, start + budget)
                sampled, finish = sampled[:budget], "length"
            session.requests += 1
            return self._response(session, conversation, sampled, request, finish=finish, prompt=conversation.token_ids[:start])

    def _extend(self, session: Session, messages: list[Mapping[str, Any]], tools: list[Any]) -> Conversation:
        """The session's conversation with the request's new messages added (see the module
        docstring)."""
        canonical = [_canonical(m) for m in messages]
        conversation = session.conversation
        if conversation is None:
            plain = [_plain(m) for m in messages]
            token_ids = self.chat.prompt_ids(plain, tools)
            conversation = Conversation(plain, "agent", {}, token_ids, prompt_length=len(token_ids), tools=list(tools))
            session.conversation, session.history = conversation, canonical
            return conversation
        known = len(session.history)
        if canonical[:known] != session.history:
            first = next(i for i in range(known) if i >= len(canonical) or canonical[i] != session.history[i])
            raise EndpointError(
                400, "invalid_request_error",
                f"this session's conversation so far has {known} messages, and a request must repeat them before "
                f"adding new ones; message {first} differs from it (or is missing). Start a new session for another "
                "conversation",
            )
        if list(tools) != conversation.tools:
            raise EndpointError(400, "invalid_request_error", "the 'tools' of a session cannot change between requests")
        if not conversation.add_messages([_plain(m) for m in messages[known:]], self.chat, self.max_total_length):
            conversation.done = conversation.truncated = True
        session.history = canonical
        return conversation

    def _room(self, conversation: Conversation) -> bool:
        return not conversation.done and len(conversation.token_ids) < self.max_total_length

    def _cut(self, conversation: Conversation, length: int) -> None:
        """Drop the tokens of the last assistant turn past ``length`` (a request's ``max_tokens``)."""
        last = conversation.messages[-1]
        start = len(conversation.token_ids) - len(last["token_ids"])
        for name in ("token_ids", "logprobs", "mask", "versions"):
            del getattr(conversation, name)[length:]
        kept = conversation.token_ids[start:]
        conversation.messages[-1] = {**last, "content": self.chat.decode(kept), "token_ids": kept}
        conversation.truncated = True

    def _response(self, session: Session, conversation: Conversation, sampled: list[int], request: Mapping[str, Any],
                  *, finish: str, prompt: Sequence[int] = ()) -> dict[str, Any]:
        text = self.chat.decode(sampled)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tool_call_format is not None and sampled:
            try:
                calls = FORMATS[self.tool_call_format](text)
            except MalformedToolCall:
                calls = []
            if calls:
                message["content"] = text_around_calls(text, self.tool_call_format) or None
                message["tool_calls"] = [
                    {"id": f"call_{session.id}_{session.requests}_{k}", "type": "function",
                     "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                    for k, call in enumerate(calls)
                ]
                finish = "tool_calls" if finish == "stop" else finish
        session.history.append(_canonical(message))
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                                  "token_ids": list(sampled), "prompt_token_ids": list(prompt)}
        if request.get("logprobs"):
            logprobs = conversation.logprobs[len(conversation.logprobs) - len(sampled):] if sampled else []
            choice["logprobs"] = {"content": [
                {"token": self.chat.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(sampled, logprobs, strict=True)
            ]}
        return {
            "id": f"chatcmpl-{session.id}-{session.requests}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(sampled),
                      "total_tokens": len(prompt) + len(sampled)},
        }


def _text(content: Any) -> str:
    """A message's content as text (OpenAI allows a list of parts)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    return str(content)


def _plain(message: Mapping[str, Any]) -> Message:
    return {"role": str(message.get("role", "user")), "content": _text(message.get("content"))}


def _canonical(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must match when an agent repeats a message: role, text, tool call ids, the id a
    tool result answers."""
    calls = tuple(call.get("id") for call in message.get("tool_calls") or [])
    return message.get("role"), _text(message.get("content")).strip(), calls, message.get("tool_call_id")


def _stop_strings(request: Mapping[str, Any]) -> list[str] | None:
    stop = request.get("stop")
    if stop is None:
        return None
    return [stop] if isinstance(stop, str) else [str(s) for s in stop]


class _Batcher:
    """Requests of all sessions, sent to the engines in batches: one ``generate`` call per
    window of ``window_s`` seconds (greedy and sampled requests apart)."""

    def __init__(self, generation: Generation, pad_token_id: int, window_s: float):
        self.generation, self.pad_token_id, self.window_s = generation, pad_token_id, window_s
        self._queue: queue.Queue[tuple[Conversation, bool, list[str] | None, Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="posttrain-endpoint-batcher", daemon=True)
        self._thread.start()

    def generate(self, conversation: Conversation, greedy: bool, stop: list[str] | None) -> tuple[Batch, int]:
        """The engines' output for ``conversation``'s tokens so far, and its row in it."""
        done: Future = Future()
        self._queue.put((conversation, greedy, stop, done))
        return done.result()

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            pending = [first]
            deadline = time.monotonic() + self.window_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    item = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                pending.append(item)
            for greedy in (False, True):
                group = [item for item in pending if item[1] is greedy]
                if group:
                    self._serve(group, greedy)

    def _serve(self, group: list[tuple[Conversation, bool, list[str] | None, Future]], greedy: bool) -> None:
        for conversation, _, stop, _ in group:
            conversation.stop_strings = stop
        try:
            outputs = self.generation.generate(generation_batch([c for c, *_ in group], self.pad_token_id), greedy=greedy)
        except BaseException as error:  # every request of the batch fails with it
            for *_, done in group:
                done.set_exception(error)
            return
        for row, (*_, done) in enumerate(group):
            done.set_result((outputs, row))


def _handler(endpoint: ChatEndpoint) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/").endswith("/v1/models"):
                self._send(200, {"object": "list", "data": [{"id": endpoint.model_name, "object": "model", "created": 0,
                                                               "owned_by": "posttrain"}]})
            else:
                self._send(404, _error(404, "not_found_error", f"no such path: GET {self.path}"))

        def do_POST(self) -> None:  # noqa: N802
            parts = self.path.strip("/").split("/")
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if len(parts) != 5 or parts[0] != "sessions" or parts[2:] != ["v1", "chat", "completions"]:
                self._send(404, _error(404, "not_found_error", f"no such path: POST {self.path}; "
                                       "use POST <base_url>/chat/completions"))
                return
            try:
                request = json.loads(body or b"{}")
                if not isinstance(request, dict):
                    raise EndpointError(400, "invalid_request_error", "the request body must be a JSON object")
                self._send(200, endpoint.complete(parts[1], request))
            except json.JSONDecodeError as error:
                self._send(400, _error(400, "invalid_request_error", f"the request body is not JSON: {error}"))
            except EndpointError as error:
                self._send(error.status, _error(error.status, error.kind, str(error)))
            except Exception as error:  # the engines failed: the agent sees it, the server goes on
                _log.warning("endpoint request failed", error=f"{type(error).__name__}: {error}")
                self._send(500, _error(500, "server_error", f"{type(error).__name__}: {error}"))

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the run logs what matters
            return

    return Handler


def _error(status: int, kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}
