"""A fake LLM service on loopback that speaks both real wire formats.

One `http.server` on 127.0.0.1:0 in a daemon thread serves:
- OpenAI-compatible `POST /v1/chat/completions`: a JSON reply, or SSE (`data: {chunk}` lines
  ending with `data: [DONE]`) whose tool calls arrive as deltas joined by `index`, with the
  `arguments` string split into several fragments;
- Ollama `POST /api/chat`: one JSON object (`"stream": false`), or NDJSON lines ending with
  `"done": true`; tool-call `arguments` is an object and calls carry no `id`.

Replies are scripted per kind of request (`chat`, `guardrail`, `summary`; the last two are
recognised by the markers the prompts start with) and fall back to defaults. Every request body
is recorded, so tests assert on the `messages`, `tools` and `model` that were sent.
`GET /v1/models` and `GET /api/tags` list `models` (or fail with `models_status`, or send
`models_body` as is). `stop()` closes the port, which is the "LLM down" behaviour.

Like a real server it honours `max_tokens` (one word = one token here; `finish_reason:
"length"`) and reports `usage` (words, and `stream_options.include_usage` for streams), unless
`report_usage` is off. It can also misbehave as real model servers were seen to: a `Reply.fault`
of "empty" (a stream with no chunk and no `[DONE]`), "no_done" (text, then the stream just ends),
"endless" (words until the client leaves, `max_tokens` ignored); `reject_null_content` answers a
message whose `content` is null with HTTP 500; `drop_after_stream` closes the connection of the
first request after a streamed reply, unanswered (llama.cpp's server did so to kept-alive ones).
"""

import contextlib
import json
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from backend.chat.prompts import GUARDRAIL_OPENINGS, SUMMARY_OPENINGS
from testkit.loopback_http import LoopbackHttpServer


@dataclass
class FakeCall:
    """A tool call to send; `arguments` as a str is sent raw (it may be malformed JSON)."""

    name: str
    arguments: dict[str, Any] | str = field(default_factory=dict)


@dataclass
class Reply:
    text: str = ""
    calls: list[FakeCall] = field(default_factory=list)
    status: int = 200  # e.g. 503 to look overloaded
    fault: str | None = None  # "empty", "no_done", "endless" (see the module docstring)


@dataclass
class Recorded:
    path: str
    kind: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list(self.body.get("messages", []))

    @property
    def tools(self) -> list[dict[str, Any]]:
        return list(self.body.get("tools", []))


class FakeLlm(LoopbackHttpServer):
    def __init__(self) -> None:
        super().__init__(_Handler)
        self.requests: list[Recorded] = []
        self.scripts: dict[str, deque[Reply]] = {
            "chat": deque(),
            "guardrail": deque(),
            "summary": deque(),
        }
        self.defaults = {
            "chat": Reply("Brush twice a day for two minutes."),
            "guardrail": Reply("YES"),
        }
        self._lock = threading.Lock()
        self._summaries = 0
        self.report_usage = True
        self.reject_null_content = False
        self.drop_after_stream = False
        self.dropped = 0  # connections closed by drop_after_stream
        self._drop_next = False
        self.endless_words = 0  # words sent by "endless" replies
        # What `GET /v1/models` and `GET /api/tags` list; `models_status` != 200 fails them.
        self.models: list[str] = ["fake-chat", "fake-guard"]
        self.models_status = 200
        self.models_body: bytes | None = None  # sent as is instead of the listing (garbled)
        self.listings = 0  # model listings served

    # ---- control ------------------------------------------------------------------------------

    def script(self, kind: str, *replies: Reply) -> None:
        with self._lock:
            self.scripts[kind].extend(replies)

    def streamed(self) -> None:
        with self._lock:
            self._drop_next = self.drop_after_stream

    def take_drop(self) -> bool:
        """Whether to drop this request: the first one after a streamed reply, once."""
        with self._lock:
            drop, self._drop_next = self._drop_next, False
            self.dropped += drop
            return drop

    def of_kind(self, kind: str) -> list[Recorded]:
        return [request for request in self.requests if request.kind == kind]

    def models_of(self, kind: str) -> list[str | None]:
        """The `model` each request of this kind asked for, in order."""
        return [request.body.get("model") for request in self.of_kind(kind)]

    # ---- serving ------------------------------------------------------------------------------

    def next_reply(self, kind: str) -> Reply:
        with self._lock:
            if self.scripts[kind]:
                return self.scripts[kind].popleft()
            if kind == "summary":
                self._summaries += 1
                return Reply(f"Summary {self._summaries}.")
            return self.defaults[kind]

    def record(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> str:
        kind = _kind(body)
        with self._lock:
            self.requests.append(Recorded(path, kind, body, headers))
        return kind


def _kind(body: dict[str, Any]) -> str:
    for message in body.get("messages", []):
        content = message.get("content") or ""
        if isinstance(content, str) and content.startswith(GUARDRAIL_OPENINGS):
            return "guardrail"
        if isinstance(content, str) and content.startswith(SUMMARY_OPENINGS):
            return "summary"
    return "chat"


def _words(value: Any) -> int:
    """The fake's token count: words, in text or in a message list."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(_words(item.get("content") or "") for item in value if isinstance(item, dict))
    return 0


def _limited(reply: Reply, body: dict[str, Any]) -> tuple[str, str]:
    """The reply's text within `max_tokens` (or Ollama's `num_predict`), and its finish reason."""
    limit = body.get("max_tokens") or (body.get("options") or {}).get("num_predict")
    words = reply.text.split(" ")
    if isinstance(limit, int) and len([w for w in words if w]) > limit:
        return " ".join(words[:limit]), "length"
    return reply.text, "tool_calls" if reply.calls else "stop"


def _usage(body: dict[str, Any], text: str, reply: Reply) -> dict[str, int]:
    prompt = _words(body.get("messages", []))
    completion = _words(text) + sum(len(_raw_arguments(call)) // 4 for call in reply.calls)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _pieces(text: str) -> list[str]:
    """Text split into word-sized deltas (spaces kept)."""
    words = text.split(" ")
    return [word + (" " if i < len(words) - 1 else "") for i, word in enumerate(words) if word]


def _fragments(text: str, count: int = 3) -> list[str]:
    size = max(1, -(-len(text) // count))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _raw_arguments(call: FakeCall) -> str:
    return call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments)


class _Handler(BaseHTTPRequestHandler):
    owner: FakeLlm
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def handle(self) -> None:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            super().handle()  # the client may close a kept-alive connection at any time

    def setup(self) -> None:
        super().setup()
        # Like real model servers (Go's net/http, uvicorn): no Nagle, or each small SSE chunk
        # waits for the client's delayed ACK (~40 ms on Linux loopback).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self) -> None:
        """The model listings: OpenAI's `/v1/models` and Ollama's `/api/tags`."""
        owner = self.owner
        with owner._lock:
            owner.listings += 1
            names, status, raw = list(owner.models), owner.models_status, owner.models_body
        if status != 200:
            self._send(status, "application/json", b'{"error": "scripted failure"}')
        elif raw is not None:
            self._send(200, "application/json", raw)
        elif self.path == "/v1/models":
            data = [{"id": name, "object": "model", "owned_by": "fake"} for name in names]
            self._send(
                200, "application/json", json.dumps({"object": "list", "data": data}).encode()
            )
        elif self.path == "/api/tags":
            tags = [{"name": name, "model": name, "size": 1} for name in names]
            self._send(200, "application/json", json.dumps({"models": tags}).encode())
        else:
            self._send(404, "application/json", b'{"error": "not found"}')

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length)
        if self.owner.take_drop():
            self.close_connection = True  # no answer at all: the client sees the socket close
            return
        body = json.loads(data or b"{}")
        headers = {key.lower(): value for key, value in self.headers.items()}
        kind = self.owner.record(self.path, body, headers)
        if self.owner.reject_null_content and any(
            message.get("content", "") is None for message in body.get("messages", [])
        ):
            self._send(500, "application/json", b'{"error": "content must be a string"}')
            return
        reply = self.owner.next_reply(kind)
        if reply.status != 200:
            self._send(reply.status, "application/json", b'{"error": "scripted failure"}')
            return
        stream = bool(body.get("stream", self.path == "/api/chat"))
        if self.path == "/v1/chat/completions":
            if stream:
                self._stream("text/event-stream", self._openai_chunks(reply, body), reply.fault)
                self.owner.streamed()
            else:
                self._send(200, "application/json", json.dumps(self._openai(reply, body)).encode())
        elif self.path == "/api/chat":
            if stream:
                lines = self._ollama_lines(body, reply)
                self._stream("application/x-ndjson", lines, reply.fault)
                self.owner.streamed()
            else:
                self._send(200, "application/json", json.dumps(self._ollama(body, reply)).encode())
        else:
            self._send(404, "application/json", b'{"error": "not found"}')

    # -- OpenAI --

    def _openai(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        text, finish = _limited(reply, body)
        if reply.fault == "empty":
            return {"id": "chatcmpl-fake", "object": "chat.completion", "choices": []}
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if reply.calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{i + 1}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": _raw_arguments(call)},
                }
                for i, call in enumerate(reply.calls)
            ]
        answer: dict[str, Any] = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        }
        if self.owner.report_usage:
            answer["usage"] = _usage(body, text, reply)
        return answer

    def _openai_chunks(self, reply: Reply, body: dict[str, Any]) -> list[bytes]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            data = {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return f"data: {json.dumps(data)}\n\n".encode()

        if reply.fault == "empty":
            return []
        text, finish = _limited(reply, body)
        out = [chunk({"role": "assistant", "content": ""})]
        out += [chunk({"content": piece}) for piece in _pieces(text)]
        for index, call in enumerate(reply.calls):
            head = {
                "index": index,
                "id": f"call_{index + 1}",
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
            out.append(chunk({"tool_calls": [head]}))
            for fragment in _fragments(_raw_arguments(call)):
                piece = {"index": index, "function": {"arguments": fragment}}
                out.append(chunk({"tool_calls": [piece]}))
        if reply.fault in ("no_done", "endless"):
            return out
        out.append(chunk({}, finish))
        if self.owner.report_usage and (body.get("stream_options") or {}).get("include_usage"):
            last: dict[str, Any] = {"id": "chatcmpl-fake", "object": "chat.completion.chunk"}
            last |= {"choices": [], "usage": _usage(body, text, reply)}
            out.append(f"data: {json.dumps(last)}\n\n".encode())
        out.append(b"data: [DONE]\n\n")
        return out

    # -- Ollama --

    def _ollama_message(self, reply: Reply, text: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reply.calls:
            message["tool_calls"] = [
                {"function": {"name": call.name, "arguments": call.arguments}}
                for call in reply.calls
            ]
        return message

    def _ollama(self, body: dict[str, Any], reply: Reply) -> dict[str, Any]:
        text, finish = _limited(reply, body)
        answer: dict[str, Any] = {
            "model": body.get("model"),
            "created_at": "2026-11-26T00:00:00Z",
            "message": self._ollama_message(reply, text),
            "done": True,
            "done_reason": "length" if finish == "length" else "stop",
        }
        if self.owner.report_usage:
            usage = _usage(body, text, reply)
            answer["prompt_eval_count"] = usage["prompt_tokens"]
            answer["eval_count"] = usage["completion_tokens"]
        return answer

    def _ollama_lines(self, body: dict[str, Any], reply: Reply) -> list[bytes]:
        model = body.get("model")
        if reply.fault == "empty":
            return []
        text, finish = _limited(reply, body)
        lines = [
            {"model": model, "message": {"role": "assistant", "content": piece}, "done": False}
            for piece in _pieces(text)
        ]
        if reply.calls:
            lines.append(
                {"model": model, "message": self._ollama_message(reply, ""), "done": False}
            )
        last: dict[str, Any] = {
            "model": model,
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": "length" if finish == "length" else "stop",
        }
        if self.owner.report_usage:
            usage = _usage(body, text, reply)
            last["prompt_eval_count"] = usage["prompt_tokens"]
            last["eval_count"] = usage["completion_tokens"]
        if reply.fault not in ("no_done", "endless"):
            lines.append(last)
        return [json.dumps(line).encode() + b"\n" for line in lines]

    # -- HTTP --

    def _send(self, status: int, content_type: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, content_type: str, parts: list[bytes], fault: str | None = None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in parts:
            self._chunk(part)
        if fault == "endless":
            self._endless(content_type)
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, part: bytes) -> None:
        self.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        self.wfile.flush()

    def _endless(self, content_type: str) -> None:
        """Words until the client goes away (a model that keeps talking)."""
        with contextlib.suppress(OSError):
            while True:
                if content_type == "text/event-stream":
                    delta = {"choices": [{"index": 0, "delta": {"content": "and "}}]}
                    self._chunk(f"data: {json.dumps(delta)}\n\n".encode())
                else:
                    line = {"message": {"role": "assistant", "content": "and "}, "done": False}
                    self._chunk(json.dumps(line).encode() + b"\n")
                self.owner.endless_words += 1
                time.sleep(0.002)
