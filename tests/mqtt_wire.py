"""A minimal MQTT 3.1.1 client on raw asyncio streams, for tests that need full control.

It behaves like stock firmware where that matters: it subscribes to nothing unless told, sets a
last will only when given one, never pings unless asked, and `abort()` drops the TCP connection
without a DISCONNECT packet (what a crashed or unplugged device does).
"""

import asyncio
import struct
from dataclasses import dataclass

CONNECT, CONNACK, PUBLISH, PUBACK = 1, 2, 3, 4
SUBSCRIBE, SUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 12, 13, 14


class MqttRefused(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"CONNACK return code {code}")
        self.code = code


@dataclass(frozen=True)
class Publish:
    topic: str
    payload: bytes
    qos: int
    retain: bool


def _string(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return struct.pack(">H", len(data)) + data


def _remaining_length(size: int) -> bytes:
    out = bytearray()
    while True:
        byte, size = size % 128, size // 128
        out.append(byte | (0x80 if size else 0))
        if not size:
            return bytes(out)


def packet(kind: int, flags: int, body: bytes) -> bytes:
    return bytes([kind << 4 | flags]) + _remaining_length(len(body)) + body


class RawMqttClient:
    def __init__(
        self, host: str, port: int, *, local_host: str | None = None, auto_ack: bool = True
    ) -> None:
        self.host = host
        self.port = port
        self.local_host = local_host  # another loopback address plays another host
        self.auto_ack = auto_ack  # False: a device that never acknowledges its downlink
        self.others: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()  # PUBREC, PINGRESP, ...
        self.connack_flags = -1
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.publishes: asyncio.Queue[Publish] = asyncio.Queue()
        self.subacks: asyncio.Queue[list[int]] = asyncio.Queue()
        self.pubacks: asyncio.Queue[int] = asyncio.Queue()
        self.closed = asyncio.Event()
        self._reader_task: asyncio.Task[None] | None = None
        self._packet_id = 0

    async def connect(
        self,
        client_id: str,
        username: str | None = None,
        password: str | None = None,
        *,
        keepalive: int = 240,
        will: tuple[str, bytes, int, bool] | None = None,
        clean_session: bool = True,
    ) -> None:
        """CONNECT and wait for CONNACK; MqttRefused for a non-zero return code."""
        local = (self.local_host, 0) if self.local_host else None
        self.reader, self.writer = await asyncio.open_connection(
            self.host, self.port, local_addr=local
        )
        flags = 0x02 if clean_session else 0
        payload = _string(client_id)
        if will is not None:
            topic, message, qos, retain = will
            flags |= 0x04 | (qos << 3) | (0x20 if retain else 0)
            payload += _string(topic) + _string(message)
        if username is not None:
            flags |= 0x80
            payload += _string(username)
        if password is not None:
            flags |= 0x40
            payload += _string(password)
        body = _string("MQTT") + bytes([4, flags]) + struct.pack(">H", keepalive) + payload
        self.writer.write(packet(CONNECT, 0, body))
        await self.writer.drain()
        kind, _flags, data = await self._read_packet()
        if kind != CONNACK:
            raise AssertionError(f"expected CONNACK, got packet type {kind}")
        self.connack_flags = data[0]
        if data[1] != 0:
            raise MqttRefused(data[1])
        self._reader_task = asyncio.create_task(self._read_loop())

    async def publish(
        self, topic: str, payload: bytes | str, *, qos: int = 0, retain: bool = False
    ) -> None:
        """PUBLISH; at QoS 1, wait for the broker's PUBACK (so the broker has the message)."""
        assert self.writer is not None
        data = payload.encode() if isinstance(payload, str) else payload
        body = _string(topic)
        packet_id = self._next_id()
        if qos:
            body += struct.pack(">H", packet_id)
        flags = (qos << 1) | (1 if retain else 0)
        self.writer.write(packet(PUBLISH, flags, body + data))
        await self.writer.drain()
        if qos:
            async with asyncio.timeout(10):
                while await self.pubacks.get() != packet_id:
                    pass

    async def subscribe(self, topic: str, qos: int = 1) -> list[int]:
        """SUBSCRIBE and return the SUBACK return codes (0x80 = refused)."""
        assert self.writer is not None
        body = struct.pack(">H", self._next_id()) + _string(topic) + bytes([qos])
        self.writer.write(packet(SUBSCRIBE, 0x02, body))
        await self.writer.drain()
        return await asyncio.wait_for(self.subacks.get(), 10)

    async def send_raw(self, data: bytes) -> None:
        """Bytes as they are: malformed packets, forged flags, a packet with a huge header."""
        assert self.writer is not None
        self.writer.write(data)
        await self.writer.drain()

    async def ping(self) -> None:
        assert self.writer is not None
        self.writer.write(packet(PINGREQ, 0, b""))
        await self.writer.drain()

    async def next_publish(self, timeout_s: float = 10.0) -> Publish:
        return await asyncio.wait_for(self.publishes.get(), timeout_s)

    async def disconnect(self) -> None:
        """A clean DISCONNECT (no will is published)."""
        if self.writer is not None and not self.writer.is_closing():
            self.writer.write(packet(DISCONNECT, 0, b""))
            await self.writer.drain()
        await self._close()

    async def abort(self) -> None:
        """Drop the connection without DISCONNECT, as a crashed device does."""
        if self.writer is not None:
            self.writer.transport.abort()
        await self._close()

    async def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        self.closed.set()

    def _next_id(self) -> int:
        self._packet_id = self._packet_id % 65535 + 1
        return self._packet_id

    async def _read_packet(self) -> tuple[int, int, bytes]:
        assert self.reader is not None
        first = (await self.reader.readexactly(1))[0]
        size, shift = 0, 0
        while True:
            byte = (await self.reader.readexactly(1))[0]
            size |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        return first >> 4, first & 0x0F, await self.reader.readexactly(size)

    async def _read_loop(self) -> None:
        assert self.writer is not None
        try:
            while True:
                kind, flags, data = await self._read_packet()
                if kind == PUBLISH:
                    qos = (flags >> 1) & 0x03
                    (length,) = struct.unpack_from(">H", data)
                    topic = data[2 : 2 + length].decode()
                    rest = data[2 + length :]
                    if qos:
                        packet_id, rest = rest[:2], rest[2:]
                        if self.auto_ack:
                            self.writer.write(packet(PUBACK, 0, packet_id))
                    await self.publishes.put(Publish(topic, rest, qos, bool(flags & 1)))
                elif kind == SUBACK:
                    await self.subacks.put(list(data[2:]))
                elif kind == PUBACK:
                    await self.pubacks.put(struct.unpack(">H", data)[0])
                else:
                    await self.others.put((kind, data))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
