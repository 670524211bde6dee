"""A fake OpenAI-compatible transcription server on loopback: `POST /v1/audio/transcriptions`.

One `http.server` on 127.0.0.1:0 in a daemon thread. It parses the real multipart body (the
`file` part and the form fields) with the standard library's email parser, records every
request, and answers what the next scripted `TranscriptionReply` says: JSON `{"text": ...}`,
an HTTP error, a raw (garbage) body, or a delay before answering. `stop()` closes the port.
"""

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler

from testkit.loopback_http import LoopbackHttpServer


@dataclass
class TranscriptionReply:
    text: str = ""
    status: int = 200
    raw: bytes | None = None  # sent as is instead of the JSON
    delay_s: float = 0.0


@dataclass
class TranscriptionRequest:
    path: str
    headers: dict[str, str]
    fields: dict[str, str] = field(default_factory=dict)
    file_name: str = ""
    file_type: str = ""
    file: bytes = b""


class FakeTranscriptionServer(LoopbackHttpServer):
    def __init__(self) -> None:
        super().__init__(_Handler)
        self.requests: list[TranscriptionRequest] = []
        self.replies: deque[TranscriptionReply] = deque()
        self.default = TranscriptionReply()
        self.received = threading.Event()  # set at the first request

    def next_reply(self) -> TranscriptionReply:
        return self.replies.popleft() if self.replies else self.default


def parse_multipart(content_type: str, body: bytes) -> TranscriptionRequest:
    message = BytesParser(policy=HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body
    )
    request = TranscriptionRequest(path="", headers={})
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True) or b""
        if name == "file":
            request.file = payload
            request.file_name = part.get_filename() or ""
            request.file_type = part.get_content_type()
        elif isinstance(name, str):
            request.fields[name] = payload.decode()
    return request


class _Handler(BaseHTTPRequestHandler):
    owner: FakeTranscriptionServer

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: tests read the recorded requests instead."""

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        request = parse_multipart(self.headers.get("Content-Type", ""), body)
        request.path = self.path
        request.headers = {key.lower(): value for key, value in self.headers.items()}
        self.owner.requests.append(request)
        self.owner.received.set()
        reply = self.owner.next_reply()
        if reply.delay_s and self.owner.stopping.wait(reply.delay_s):
            return
        if self.path != "/v1/audio/transcriptions":
            reply = TranscriptionReply(status=404, raw=b'{"error": "not found"}')
        payload = reply.raw if reply.raw is not None else json.dumps({"text": reply.text}).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        try:
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            return  # the client gave up (a timeout test)
