"""The firmware's own WebSocket client (firmware/lib/transport_ws.py) against real peers on
loopback: a `websockets` server, a raw TCP server for malformed replies, and the same client code
running under the MicroPython unix port."""

import asyncio
import base64
import hashlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request

from simulator.firmware import firmware_module
from tests.firmware_helpers import needs_micropython, run_micropython, serving

ws = firmware_module("transport_ws")

DEVICE_HEADERS = {
    "Authorization": "Bearer device-token",
    "Protocol-Version": "1",
    "Device-Id": "a4:cf:12:34:56:78",
    "Client-Id": "7f0c1c8e-3d7e-4f5e-9a43-0d2b1e6c9a10",
}
GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Peer:
    """A `websockets` server whose behaviour is chosen by the request path."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.received: list[str | bytes] = []
        self.close_codes: list[int | None] = []
        self.pongs = 0
        self.port = 0

    def url(self, path: str = "/echo") -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    async def process_request(self, connection: ServerConnection, request: Request) -> Any:
        self.requests.append(request)
        if request.path == "/reject":
            return connection.respond(HTTPStatus.UNAUTHORIZED, "invalid device token\n")
        return None

    async def handler(self, connection: ServerConnection) -> None:
        try:
            async for message in connection:
                self.received.append(message)
                await self.command(connection, message)
        except ConnectionClosed:
            pass
        self.close_codes.append(connection.close_code)

    async def command(self, connection: ServerConnection, message: str | bytes) -> None:
        if message == "ping me":
            pong = await connection.ping(b"are you there")
            await asyncio.wait_for(pong, 5)
            self.pongs += 1
            await connection.send("pong received")
        elif message == "fragments":
            await connection.send(["first-", "second-", "third"])
        elif message == "binary please":
            await connection.send(b"\x00\x01\xfe\xff")
        elif message == "too big":
            await connection.send("x" * 70_000)
        elif message == "bye":
            await connection.close(1001, "going away")
        else:
            await connection.send(message)


@pytest.fixture
async def peer() -> AsyncIterator[Peer]:
    async with serving(Peer()) as peer:
        yield peer


async def connected(url: str, **kwargs: Any) -> Any:
    transport = ws.WsTransport(url, DEVICE_HEADERS, **kwargs)
    await transport.connect()
    return transport


async def wait_until(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():  # noqa: ASYNC110  (state owned by the code under test)
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), 5)


# ---- against a real websockets server ----------------------------------------------------------


async def test_handshake_sends_the_stock_headers(peer: Peer) -> None:
    transport = await connected(peer.url("/xiaozhi/v1/?tenant=a"))
    await transport.close()
    request = peer.requests[0]
    assert request.path == "/xiaozhi/v1/?tenant=a"
    assert request.headers["Host"] == "127.0.0.1"  # stock sends the host without the port
    assert request.headers["Authorization"] == "Bearer device-token"
    assert request.headers["Protocol-Version"] == "1"
    assert request.headers["Device-Id"] == "a4:cf:12:34:56:78"
    assert request.headers["Client-Id"] == DEVICE_HEADERS["Client-Id"]
    assert "Sec-WebSocket-Extensions" not in request.headers


async def test_text_and_binary_round_trip(peer: Peer) -> None:
    transport = await connected(peer.url())
    await transport.send('{"type":"hello","text":"grüß dich"}')
    assert await transport.receive() == '{"type":"hello","text":"grüß dich"}'
    await transport.send(b"\x01\x02\x03")
    assert await transport.receive() == b"\x01\x02\x03"
    await transport.send("binary please")
    assert await transport.receive() == b"\x00\x01\xfe\xff"
    await transport.close()
    assert peer.received[:2] == ['{"type":"hello","text":"grüß dich"}', b"\x01\x02\x03"]


async def test_large_frames_use_both_extended_lengths(peer: Peer) -> None:
    transport = await connected(peer.url())
    for size in (125, 126, 65_535):
        text = "a" * size
        await transport.send(text)
        assert await transport.receive() == text
    await transport.close()


async def test_server_ping_is_answered_with_a_pong(peer: Peer) -> None:
    transport = await connected(peer.url())
    await transport.send("ping me")
    assert await transport.receive() == "pong received"  # read after the pong went out
    assert peer.pongs == 1
    await transport.close()


async def test_fragmented_server_message_is_reassembled(peer: Peer) -> None:
    transport = await connected(peer.url())
    await transport.send("fragments")
    assert await transport.receive() == "first-second-third"
    await transport.send("still here")
    assert await transport.receive() == "still here"
    await transport.close()


async def test_http_401_is_raised_with_its_status(peer: Peer) -> None:
    transport = ws.WsTransport(peer.url("/reject"), DEVICE_HEADERS)
    with pytest.raises(ws.HandshakeError) as info:
        await transport.connect()
    assert info.value.status == 401
    assert str(info.value).startswith("rejected: HTTP 401")
    assert isinstance(info.value, ValueError)
    assert await transport.receive() is None


async def test_oversize_incoming_frame_fails_the_link(peer: Peer) -> None:
    transport = await connected(peer.url())
    await transport.send("too big")
    with pytest.raises(ws.ProtocolError, match="70000 bytes exceeds the 65536-byte limit"):
        await transport.receive()
    assert await transport.receive() is None
    with pytest.raises(OSError):
        await transport.send("after the failure")
    await wait_until(lambda: bool(peer.close_codes))
    assert peer.close_codes == [1009]


async def test_oversize_outgoing_message_is_refused_before_sending(peer: Peer) -> None:
    transport = await connected(peer.url())
    with pytest.raises(ValueError, match="65536 bytes exceeds the 65535-byte limit"):
        await transport.send("b" * 65_536)
    await transport.send("small")
    assert await transport.receive() == "small"
    await transport.close()
    assert peer.received == ["small"]


async def test_server_close_ends_receive_with_none(peer: Peer) -> None:
    transport = await connected(peer.url())
    await transport.send("bye")
    assert await transport.receive() is None
    assert transport.close_code == 1001
    assert await transport.receive() is None
    await wait_until(lambda: bool(peer.close_codes))
    assert peer.close_codes == [1001]  # our close reply echoed the server's code


async def test_client_close_completes_the_closing_handshake(peer: Peer) -> None:
    transport = await connected(peer.url())
    await transport.close()
    assert not transport.is_open
    await wait_until(lambda: bool(peer.close_codes))
    assert peer.close_codes == [1000]


async def test_close_while_another_task_receives(peer: Peer) -> None:
    transport = await connected(peer.url())
    receiving = asyncio.create_task(transport.receive())
    await asyncio.sleep(0.05)
    await transport.close()
    assert await receiving is None
    await wait_until(lambda: bool(peer.close_codes))
    assert peer.close_codes == [1000]


async def test_close_during_the_handshake_cancels_it() -> None:
    requested, answer = asyncio.Event(), asyncio.Event()

    async def slow_response(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        requested.set()
        await answer.wait()
        writer.close()

    server = await asyncio.start_server(slow_response, "127.0.0.1", 0)
    async with server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        transport = ws.WsTransport(url, DEVICE_HEADERS)
        connecting = asyncio.create_task(transport.connect())
        await asyncio.wait_for(requested.wait(), 5)
        await transport.close()
        with pytest.raises(OSError):
            await connecting
        answer.set()
    assert not transport.is_open
    assert await transport.receive() is None


async def test_connection_refused_is_an_oserror() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    transport = ws.WsTransport(f"ws://127.0.0.1:{port}/", DEVICE_HEADERS)
    with pytest.raises(OSError):
        await transport.connect()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("wss://example.com/", "TLS not supported"),
        ("http://example.com/", "unsupported URL scheme"),
        ("ws://:80/", "missing or bad host"),
        ("ws://host:99999/", "bad port"),
        ("example.com", "bad WebSocket URL"),
    ],
)
async def test_bad_url_is_a_value_error(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        await ws.WsTransport(url, DEVICE_HEADERS).connect()


async def test_header_with_newline_is_refused(peer: Peer) -> None:
    headers = {**DEVICE_HEADERS, "Authorization": "Bearer x\r\nX-Injected: 1"}
    with pytest.raises(ValueError, match="bad WebSocket header"):
        await ws.WsTransport(peer.url(), headers).connect()
    assert peer.requests == []


# ---- against a raw TCP peer that misbehaves ----------------------------------------------------


class RawPeer:
    """Answers the upgrade with `response(key)`, writes `frames`, then records the client's close
    frame (or hangs up at once)."""

    def __init__(
        self, response: Callable[[str], bytes], frames: bytes = b"", hang_up: bool = False
    ) -> None:
        self.response = response
        self.frames = frames
        self.hang_up = hang_up
        self.from_client = b""
        self.done = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        key = next(
            line.split(b":", 1)[1].strip().decode()
            for line in request.split(b"\r\n")
            if line.lower().startswith(b"sec-websocket-key:")
        )
        writer.write(self.response(key) + self.frames)
        await writer.drain()
        if not self.hang_up:  # wait for the client's close frame (2 + 4 + 2 bytes)
            self.from_client = await reader.readexactly(8)
        writer.close()
        self.done.set()


def accept_for(key: str) -> str:
    return base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()


def upgrade_response(key: str) -> bytes:
    return (
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Accept: {accept_for(key)}\r\n\r\n"
    ).encode()


def client_close_code(data: bytes) -> int:
    """Close code of the (masked) close frame the client sent last."""
    assert data[0] == 0x88 and data[1] & 0x80, data[:2]
    key, payload = data[2:6], data[6 : 6 + (data[1] & 0x7F)]
    unmasked = bytes(byte ^ key[i % 4] for i, byte in enumerate(payload))
    return struct.unpack(">H", unmasked[:2])[0]


@pytest.fixture
async def raw_peer() -> AsyncIterator[Callable[[RawPeer], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(behaviour: RawPeer) -> str:
        server = await asyncio.start_server(behaviour.handle, "127.0.0.1", 0)
        servers.append(server)
        return f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/"

    yield start
    for server in servers:
        server.close()


@pytest.mark.parametrize(
    ("frame", "problem", "code"),
    [
        (b"\x81\x83abcdxyz", "masked frame", 1002),
        (b"\xc1\x02hi", "reserved bits", 1002),
        (b"\x83\x00", "unknown frame opcode 3", 1002),
        (b"\x80\x02hi", "continuation frame without", 1002),
        (b"\x01\x02hi\x81\x02hi", "new message started inside", 1002),
        (b"\x89\x7e\x00\x80" + b"p" * 128, "control frame", 1002),
        (b"\x81\x02\xff\xfe", "not valid UTF-8", 1007),
    ],
)
async def test_malformed_server_frame_fails_the_link(
    raw_peer: Any, frame: bytes, problem: str, code: int
) -> None:
    behaviour = RawPeer(upgrade_response, frame)
    transport = await connected(await raw_peer(behaviour))
    with pytest.raises(ws.ProtocolError, match=problem):
        await transport.receive()
    assert await transport.receive() is None
    await asyncio.wait_for(behaviour.done.wait(), 5)
    assert client_close_code(behaviour.from_client) == code


async def test_oversize_fragmented_message_fails_the_link(raw_peer: Any) -> None:
    chunk = b"y" * 40_000
    frames = b"\x01\x7e" + struct.pack(">H", 40_000) + chunk
    frames += b"\x80\x7e" + struct.pack(">H", 40_000) + chunk
    behaviour = RawPeer(upgrade_response, frames)
    transport = await connected(await raw_peer(behaviour))
    with pytest.raises(ws.ProtocolError, match="fragmented message exceeds"):
        await transport.receive()
    await asyncio.wait_for(behaviour.done.wait(), 5)
    assert client_close_code(behaviour.from_client) == 1009


@pytest.mark.parametrize(
    ("response", "error", "message"),
    [
        (
            lambda key: b"HTTP/1.1 101 OK\r\nSec-WebSocket-Accept: wrong=\r\n\r\n",
            ValueError,
            "Accept",
        ),
        (lambda key: b"SSH-2.0-OpenSSH_9.2\r\n", ValueError, "not an HTTP response"),
        (lambda key: b"\xff\xfe\xfd\r\n", ValueError, "not text"),
        (lambda key: b"HTTP/1.1 101 OK\r\n" + b"X-A: b\r\n" * 100, ValueError, "too many header"),
        (lambda key: b"HTTP/1.1 400 Bad Request\r\n\r\n", ValueError, "rejected: HTTP 400"),
        (lambda key: b"HTTP/1.1 101 Switch", OSError, "closed during the WebSocket handshake"),
    ],
)
async def test_bad_upgrade_response_is_refused(
    raw_peer: Any, response: Callable[[str], bytes], error: type[Exception], message: str
) -> None:
    behaviour = RawPeer(response, hang_up=True)
    transport = ws.WsTransport(await raw_peer(behaviour), DEVICE_HEADERS)
    with pytest.raises(error, match=message):
        await transport.connect()
    assert not transport.is_open


async def test_silent_server_times_out_as_oserror(raw_peer: Any) -> None:
    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    async with server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        with pytest.raises(OSError, match="timed out"):
            await ws.WsTransport(url, DEVICE_HEADERS, timeout_s=0.2).connect()


# ---- the same client under the MicroPython unix port -------------------------------------------

MPY_CLIENT = r"""
import asyncio, json, sys
import transport_ws

HEADERS = {"Authorization": "Bearer device-token", "Protocol-Version": "1",
           "Device-Id": "a4:cf:12:34:56:78", "Client-Id": "mpy-client"}

def report(step, value):
    print(json.dumps({"step": step, "value": value}))

async def main(base):
    link = transport_ws.WsTransport(base + "/echo", HEADERS)
    await link.connect()
    await link.send("hello from micropython")
    report("echo", await link.receive())
    await link.send("ping me")
    report("ping", await link.receive())
    await link.send("fragments")
    report("fragments", await link.receive())
    await link.send("b" * 65535)
    report("big_echo", len(await link.receive()))
    try:
        await link.send("c" * 65536)
    except ValueError as error:
        report("send_limit", str(error))
    await link.send("too big")
    try:
        await link.receive()
    except transport_ws.ProtocolError as error:
        report("oversize", str(error))
    report("after_fail", await link.receive())

    link = transport_ws.WsTransport(base + "/echo", HEADERS)
    await link.connect()
    await link.send("bye")
    report("server_close", [await link.receive(), link.close_code])

    link = transport_ws.WsTransport(base + "/echo", HEADERS)
    await link.connect()
    receiving = asyncio.create_task(link.receive())
    await asyncio.sleep(0.05)
    await link.close()
    report("close_while_receiving", await receiving)

    try:
        await transport_ws.WsTransport(base + "/reject", HEADERS).connect()
    except transport_ws.HandshakeError as error:
        report("reject", [error.status, str(error)])
    try:
        await transport_ws.WsTransport(sys.argv[2], HEADERS).connect()
    except OSError as error:
        report("refused", type(error).__name__)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.micropython
@needs_micropython
async def test_micropython_client_against_websockets_server(peer: Peer, tmp_path: Path) -> None:
    script = tmp_path / "mpy_client.py"
    script.write_text(MPY_CLIENT)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        refused_url = f"ws://127.0.0.1:{probe.getsockname()[1]}/"
    code, out, err = await run_micropython(
        script, f"ws://127.0.0.1:{peer.port}", refused_url, timeout_s=60
    )
    assert code == 0, err
    steps = {item["step"]: item["value"] for item in map(json.loads, out.splitlines())}
    assert steps["echo"] == "hello from micropython"
    assert steps["ping"] == "pong received"
    assert steps["fragments"] == "first-second-third"
    assert steps["big_echo"] == 65_535
    assert "65536 bytes exceeds the 65535-byte limit" in steps["send_limit"]
    assert "70000 bytes exceeds the 65536-byte limit" in steps["oversize"]
    assert steps["after_fail"] is None
    assert steps["server_close"] == [None, 1001]
    assert steps["close_while_receiving"] is None
    assert steps["reject"] == [401, "rejected: HTTP 401 (Unauthorized)"]
    assert steps["refused"] == "OSError"
    assert peer.pongs == 1
    assert peer.requests[0].headers["Device-Id"] == "a4:cf:12:34:56:78"
    assert peer.requests[0].headers["Host"] == "127.0.0.1"
    assert sorted(peer.close_codes) == [1000, 1001, 1009]
