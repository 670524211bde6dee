"""A fake OpenAI-compatible speech server on loopback: `POST /v1/audio/speech`.

One `http.server` on 127.0.0.1:0 in a daemon thread answers with what the next scripted
`SpeechReply` says: raw PCM (`audio/pcm`, as OpenAI streams `response_format: "pcm"`) or a
streamed WAV (`audio/wav` with the placeholder data size streaming servers write), sent with
chunked transfer encoding in the piece sizes asked for (odd ones included), an HTTP error, a
delay before the headers, or a connection cut after some pieces. Every request is recorded
(path, headers, JSON body). `stop()` closes the port, which is the "server down" behaviour.
"""

import contextlib
import json
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from testkit.loopback_http import LoopbackHttpServer


@dataclass
class SpeechReply:
    pcm: bytes = b""  # s16le mono at `rate`
    pieces: list[int] = field(default_factory=list)  # body piece sizes; the rest goes last
    status: int = 200
    delay_s: float = 0.0  # wait before answering (a slow server)
    wav: bool = False
    rate: int = 24000  # what a WAV header announces (raw PCM is 24 kHz by the API's contract)
    cut_after: int | None = None  # close the connection after this many pieces


@dataclass
class SpeechRequest:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class FakeSpeechServer(LoopbackHttpServer):
    def __init__(self) -> None:
        super().__init__(_Handler)
        self.requests: list[SpeechRequest] = []
        self.replies: deque[SpeechReply] = deque()
        self.default = SpeechReply()
        self._lock = threading.Lock()

    def script(self, *replies: SpeechReply) -> None:
        with self._lock:
            self.replies.extend(replies)

    def next_reply(self, request: SpeechRequest) -> SpeechReply:
        with self._lock:
            self.requests.append(request)
            return self.replies.popleft() if self.replies else self.default

    def wait(self, seconds: float) -> None:
        self.stopping.wait(seconds)


def streamed_wav_header(rate: int) -> bytes:
    """A mono 16-bit WAV header with a LIST chunk before `data` and the placeholder sizes
    streaming servers write (they do not know the length yet)."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    odd_chunk = b"LIST" + struct.pack("<I", 5) + b"INFOx" + b"\x00"  # odd size, padded
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + odd_chunk
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


def _split(data: bytes, sizes: list[int]) -> list[bytes]:
    parts, position = [], 0
    for size in sizes:
        parts.append(data[position : position + size])
        position += size
    if position < len(data):
        parts.append(data[position:])
    return [part for part in parts if part]


class _Handler(BaseHTTPRequestHandler):
    owner: FakeSpeechServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def handle(self) -> None:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            super().handle()

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        headers = {key.lower(): value for key, value in self.headers.items()}
        reply = self.owner.next_reply(SpeechRequest(self.path, headers, body))
        if reply.delay_s:
            self.owner.wait(reply.delay_s)
        if self.path != "/v1/audio/speech":
            self._error(404, "not found")
        elif reply.status != 200:
            self._error(reply.status, "scripted failure")
        else:
            self._stream(reply)

    def _error(self, status: int, message: str) -> None:
        data = json.dumps({"error": {"message": message}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, reply: SpeechReply) -> None:
        data = (streamed_wav_header(reply.rate) if reply.wav else b"") + reply.pcm
        self.send_response(200)
        self.send_header("Content-Type", "audio/wav" if reply.wav else "audio/pcm")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for index, piece in enumerate(_split(data, reply.pieces)):
            if reply.cut_after is not None and index >= reply.cut_after:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)  # mid-body: no final chunk
                return
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.flush()
            time.sleep(0.002)  # separate TCP segments, so the client sees separate pieces
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
