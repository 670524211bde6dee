"""The two ways a stock device reaches its server, as used by `simulator.voice_client`.

`WebSocketLink`: one WebSocket with the stock headers (§1.1); JSON as text frames, audio as
binary frames in protocol version 1, 2 or 3 (`backend.protocol.audio`).
`MqttUdpLink`: MQTT like stock firmware (client id `GID_xiaozhi@@@<key>@@@<uuid>`, no will,
no subscription unless asked: the server pushes to it), every JSON message published to the
publish topic; audio in AES-128-CTR UDP datagrams (§2.3) once the server hello's `udp` block
is known, with the firmware's downlink checks (type 0x01, exact length, sequence increasing).

A link calls `on_text(str)` / `on_audio(bytes)` for what arrives and `on_closed(reason)` once.
"""

import asyncio
import contextlib
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import aiomqtt
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from backend.protocol.audio import AudioFrameError, decode_audio, encode_audio

UDP_HEADER = 16
UDP_TYPE_AUDIO = 0x01


class LinkEvents(Protocol):
    def on_text(self, text: str) -> None: ...
    def on_audio(self, payload: bytes) -> None: ...
    def on_closed(self, reason: str) -> None: ...


class Link(Protocol):
    async def open(self, events: LinkEvents) -> None: ...
    async def send_text(self, text: str) -> None: ...
    async def send_audio(self, payload: bytes) -> None: ...
    async def open_audio(self, hello: dict[str, Any]) -> None: ...
    async def close(self) -> None: ...


# ---- WebSocket ----------------------------------------------------------------------------------


@dataclass
class WebSocketLink:
    url: str
    token: str | None
    device_id: str
    client_id: str
    version: int = 1
    bad_frames: int = 0  # binary frames that did not match the framing version
    _ws: ClientConnection | None = None
    _reader: asyncio.Task[None] | None = None

    def headers(self) -> dict[str, str]:
        headers = {
            "Protocol-Version": str(self.version),
            "Device-Id": self.device_id,
            "Client-Id": self.client_id,
        }
        if self.token:  # a token with a space is sent verbatim, as the firmware does
            headers["Authorization"] = self.token if " " in self.token else f"Bearer {self.token}"
        return headers

    async def open(self, events: LinkEvents) -> None:
        self._ws = await connect(
            self.url, additional_headers=self.headers(), compression=None, open_timeout=10
        )
        self._reader = asyncio.create_task(self._read(self._ws, events))

    async def _read(self, ws: ClientConnection, events: LinkEvents) -> None:
        reason = "closed by the server"
        try:
            async for message in ws:
                if isinstance(message, str):
                    events.on_text(message)
                    continue
                try:
                    events.on_audio(decode_audio(self.version, message).payload)
                except AudioFrameError:
                    self.bad_frames += 1
        except ConnectionClosed as exc:
            reason = f"connection closed: {exc}"
        events.on_closed(reason)

    async def send_text(self, text: str) -> None:
        assert self._ws is not None, "not connected"
        await self._ws.send(text)

    async def send_audio(self, payload: bytes) -> None:
        assert self._ws is not None, "not connected"
        await self._ws.send(encode_audio(self.version, payload))

    async def open_audio(self, hello: dict[str, Any]) -> None:
        """Audio shares the WebSocket: nothing to open."""

    async def close(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        await _finish(self._reader)


# ---- MQTT + UDP ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class UdpParams:
    server: str
    port: int
    key: bytes
    nonce: bytes

    @classmethod
    def parse(cls, block: Any) -> "UdpParams":
        """The hello's `udp` block; ValueError where the stock firmware would ignore the hello."""
        if not isinstance(block, dict):
            raise ValueError("server hello has no udp object")
        server, port = block.get("server"), block.get("port")
        if not isinstance(server, str) or not server:
            raise ValueError(f"udp.server must be a string, got {server!r}")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"udp.port must be 1..65535, got {port!r}")
        key, nonce = _hex16(block.get("key"), "key"), _hex16(block.get("nonce"), "nonce")
        return cls(server, port, key, nonce)


def _hex16(value: Any, name: str) -> bytes:
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise ValueError(f"udp.{name} must be 32 hex digits, got {value!r}")
    return raw


def aes_ctr(key: bytes, header: bytes, data: bytes) -> bytes:
    """AES-128-CTR with the whole 16-byte header as the initial counter block."""
    cipher = Cipher(algorithms.AES(key), modes.CTR(header)).encryptor()
    return cipher.update(data) + cipher.finalize()


def uplink_datagram(params: UdpParams, payload: bytes, sequence: int, timestamp: int = 0) -> bytes:
    """The nonce with bytes 2-3 (length), 8-11 (timestamp), 12-15 (sequence) overwritten."""
    header = bytearray(params.nonce)
    header[2:4] = struct.pack(">H", len(payload))
    header[8:16] = struct.pack(">II", timestamp & 0xFFFFFFFF, sequence & 0xFFFFFFFF)
    return bytes(header) + aes_ctr(params.key, bytes(header), payload)


class UdpAudio(asyncio.DatagramProtocol):
    """One conversation's UDP socket, with the firmware ≥ 2.4 downlink checks."""

    def __init__(self, params: UdpParams, on_audio: Callable[[bytes], None]) -> None:
        self.params = params
        self.on_audio = on_audio
        self.sent = 0
        self.received = 0
        self.drops = 0
        self._last_downlink_seq = 0
        self._transport: asyncio.DatagramTransport | None = None

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        address = (self.params.server, self.params.port)
        await loop.create_datagram_endpoint(lambda: self, remote_addr=address)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Python 3.11's selector transport does not subclass DatagramTransport: cast, not check.
        self._transport = cast(asyncio.DatagramTransport, transport)

    def send(self, payload: bytes) -> None:
        assert self._transport is not None, "UDP audio is not open"
        self.sent += 1  # the uplink sequence starts at 1 after each hello
        self._transport.sendto(uplink_datagram(self.params, payload, self.sent))

    def datagram_received(self, data: bytes, addr: tuple[str | Any, int]) -> None:
        if len(data) < UDP_HEADER or data[0] != UDP_TYPE_AUDIO:
            self.drops += 1
            return
        (length,) = struct.unpack_from(">H", data, 2)
        (sequence,) = struct.unpack_from(">I", data, 12)
        if len(data) != UDP_HEADER + length or sequence <= self._last_downlink_seq:
            self.drops += 1
            return
        self._last_downlink_seq = sequence
        self.received += 1
        self.on_audio(aes_ctr(self.params.key, data[:UDP_HEADER], data[UDP_HEADER:]))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


@dataclass
class MqttUdpLink:
    url: str  # mqtt://host:port
    client_id: str  # the MQTT client id, GID_…@@@<key>@@@<uuid> for a stock device
    username: str
    password: str
    publish_topic: str
    subscribe_topic: str | None = None  # stock firmware subscribes to nothing
    keepalive: int = 240
    udp: UdpAudio | None = None
    _client: aiomqtt.Client | None = None
    _reader: asyncio.Task[None] | None = None
    _events: LinkEvents | None = None

    async def open(self, events: LinkEvents) -> None:
        parts = urlsplit(self.url)
        client = aiomqtt.Client(
            parts.hostname or "127.0.0.1",
            parts.port or 1883,
            identifier=self.client_id,
            username=self.username,
            password=self.password,
            keepalive=self.keepalive,
            clean_session=True,
            timeout=10,
        )
        await client.__aenter__()
        self._client, self._events = client, events
        if self.subscribe_topic:
            await client.subscribe(self.subscribe_topic, qos=1)
        self._reader = asyncio.create_task(self._read(client, events))

    async def _read(self, client: aiomqtt.Client, events: LinkEvents) -> None:
        reason = "closed"
        try:
            async for message in client.messages:
                payload = message.payload
                if isinstance(payload, bytes | bytearray):
                    events.on_text(bytes(payload).decode("utf-8", "replace"))
        except aiomqtt.MqttError as exc:
            reason = f"MQTT link lost: {exc}"
        events.on_closed(reason)

    async def send_text(self, text: str) -> None:
        assert self._client is not None, "not connected"
        await self._client.publish(self.publish_topic, text.encode(), qos=0)

    async def open_audio(self, hello: dict[str, Any]) -> None:
        """A server hello arrived: (re)open the UDP channel it describes."""
        params = UdpParams.parse(hello.get("udp"))
        if self.udp is not None:
            self.udp.close()
        assert self._events is not None
        self.udp = UdpAudio(params, self._events.on_audio)
        await self.udp.open()

    async def send_audio(self, payload: bytes) -> None:
        assert self.udp is not None, "no UDP channel: the server hello has not arrived"
        self.udp.send(payload)

    async def close(self) -> None:
        if self.udp is not None:
            self.udp.close()
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.__aexit__(None, None, None)
        await _finish(self._reader)


async def _finish(task: asyncio.Task[None] | None) -> None:
    if task is None or task.done():
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
