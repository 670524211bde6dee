"""A fake OpenAI-compatible vision model on loopback: `POST /v1/chat/completions`.

It answers at once (zero latency: the benchmark's model) with the next scripted `VisionReply`
(text, an HTTP error, a raw body, or a delay), and records every request: the model, the
question, the `image_url` it got (a `data:` URL) and the image bytes decoded from it, so tests
assert that the photo reached the model byte for byte. `stop()` closes the port ("model down").
"""

import base64
import json
import threading
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from testkit.loopback_http import LoopbackHttpServer


@dataclass
class VisionReply:
    text: str = "A small dental mirror on a white table."
    status: int = 200
    raw: bytes | None = None  # sent as is instead of the JSON
    delay_s: float = 0.0


@dataclass
class VisionRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    question: str = ""
    image_url: str = ""
    image: bytes = b""
    media_type: str = ""


class FakeVisionModel(LoopbackHttpServer):
    def __init__(self) -> None:
        super().__init__(_Handler)
        self.requests: list[VisionRequest] = []
        self.replies: deque[VisionReply] = deque()
        self.default = VisionReply()
        self._lock = threading.Lock()

    def next_reply(self) -> VisionReply:
        with self._lock:
            return self.replies.popleft() if self.replies else self.default


def read_request(path: str, headers: dict[str, str], body: dict[str, Any]) -> VisionRequest:
    """The question and the image of an OpenAI chat request with an `image_url` part."""
    request = VisionRequest(path, headers, body)
    for message in body.get("messages", []):
        content = message.get("content")
        if message.get("role") != "user" or not isinstance(content, list):
            continue
        for part in content:
            if part.get("type") == "text":
                request.question = part.get("text", "")
            elif part.get("type") == "image_url":
                request.image_url = part.get("image_url", {}).get("url", "")
    head, _, data = request.image_url.partition(",")
    if head.startswith("data:") and head.endswith(";base64"):
        request.media_type = head[5:].removesuffix(";base64")
        request.image = base64.b64decode(data)
    return request


class _Handler(BaseHTTPRequestHandler):
    owner: FakeVisionModel

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: tests read the recorded requests instead."""

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        headers = {key.lower(): value for key, value in self.headers.items()}
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        with self.owner._lock:
            self.owner.requests.append(read_request(self.path, headers, body))
        reply = self.owner.next_reply()
        if reply.delay_s and self.owner.stopping.wait(reply.delay_s):
            return
        if self.path != "/v1/chat/completions":
            reply = VisionReply(status=404, raw=b'{"error": "not found"}')
        payload = reply.raw
        if payload is None:
            message = {"role": "assistant", "content": reply.text}
            payload = json.dumps(
                {"object": "chat.completion", "choices": [{"index": 0, "message": message}]}
            ).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        try:
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            return  # the client gave up (a timeout test)
