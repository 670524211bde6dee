"""MQTT 3.1.1 packets as the device side of the bridge needs them: a sans-I/O codec.

It parses what a device sends (CONNECT, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBSCRIBE,
UNSUBSCRIBE, PINGREQ, DISCONNECT) and builds what the bridge answers (CONNACK, PUBLISH, PUBACK,
PUBREC, PUBCOMP, SUBACK, UNSUBACK, PINGRESP). It knows bytes, never sockets (the endpoint in
`backend.transports.mqtt_endpoint` does the I/O), so it is fuzzed like every other parser.

`PacketReader` takes bytes as they arrive and yields whole packets. The size bound is checked
from the fixed header, before the body is buffered: an oversized packet costs its header, not
its body. Anything that breaks the 3.1.1 rules the bridge relies on raises `MalformedPacket`,
after which the connection must be closed (MQTT 3.1.1 §4.8).
"""

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from backend.errors import BridgeError

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP, DISCONNECT = 8, 9, 10, 11, 12, 13, 14

# CONNACK return codes (§3.2.2.3)
ACCEPTED = 0
UNACCEPTABLE_PROTOCOL = 1
IDENTIFIER_REJECTED = 2
BAD_USERNAME_PASSWORD = 4
NOT_AUTHORIZED = 5
SUBSCRIBE_FAILURE = 0x80

MAX_REMAINING_LENGTH = 268_435_455  # four length bytes (§2.2.3)
_FIXED_FLAGS = {PUBREL: 2, SUBSCRIBE: 2, UNSUBSCRIBE: 2}  # required flags; 0 for the others


class MalformedPacket(BridgeError):
    """Bytes that are not a valid MQTT 3.1.1 packet: the connection must be closed."""


class PacketTooLarge(MalformedPacket):
    """A packet whose remaining length is past the reader's bound (its body is never read)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"packet of {size} bytes is larger than the {limit}-byte limit")
        self.size = size
        self.limit = limit


@dataclass(frozen=True, slots=True)
class Will:
    """The last-will message a CONNECT asks the broker to publish if the client vanishes."""

    topic: str
    payload: bytes
    qos: int
    retain: bool


@dataclass(frozen=True, slots=True)
class Connect:
    """A parsed MQTT 3.1.1 CONNECT."""

    client_id: str
    username: str | None
    password: str | None
    keepalive_s: int
    clean_session: bool
    will: Will | None
    protocol_level: int


@dataclass(frozen=True, slots=True)
class Publish:
    """A parsed PUBLISH; `packet_id` is set only for QoS 1 and 2."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int | None


@dataclass(frozen=True, slots=True)
class Ack:
    """PUBACK, PUBREC, PUBREL or PUBCOMP (`kind`) of one packet id."""

    kind: int
    packet_id: int


@dataclass(frozen=True, slots=True)
class Subscribe:
    """A parsed SUBSCRIBE: topic filters with their requested QoS."""

    packet_id: int
    filters: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    """A parsed UNSUBSCRIBE."""

    packet_id: int
    filters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Simple:
    """A packet with no variable part: PINGREQ or DISCONNECT (`kind`)."""

    kind: int


Packet = Connect | Publish | Ack | Subscribe | Unsubscribe | Simple


# ---- decoding -------------------------------------------------------------------------------


class PacketReader:
    """Incremental decoder: `feed(data)`, then iterate `packets()` until it stops.

    `max_packet_bytes` bounds the remaining length of any packet; the buffer never holds more
    than one packet's worth plus what arrived with it.
    """

    __slots__ = ("_buffer", "max_packet_bytes")

    def __init__(self, max_packet_bytes: int) -> None:
        self.max_packet_bytes = max_packet_bytes
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received but not yet parsed into a packet."""
        return len(self._buffer)

    def feed(self, data: bytes) -> None:
        """Append bytes from the socket; `packets()` takes out the complete ones."""
        self._buffer += data

    def packets(self) -> Iterator[Packet]:
        """Every whole packet buffered so far, in order; MalformedPacket on the first bad one."""
        while True:
            header = _fixed_header(self._buffer)
            if header is None:
                return
            kind_flags, size, offset = header
            if size > self.max_packet_bytes:
                raise PacketTooLarge(size, self.max_packet_bytes)
            end = offset + size
            if len(self._buffer) < end:
                return
            body = bytes(self._buffer[offset:end])
            del self._buffer[:end]
            yield decode(kind_flags, body)


def _fixed_header(buffer: bytearray) -> tuple[int, int, int] | None:
    """(first byte, remaining length, header size), or None until the header is complete."""
    if len(buffer) < 2:
        return None
    size = 0
    for index in range(1, 5):
        if index >= len(buffer):
            return None
        byte = buffer[index]
        size |= (byte & 0x7F) << (7 * (index - 1))
        if not byte & 0x80:
            return buffer[0], size, index + 1
    raise MalformedPacket("remaining length longer than four bytes")


def decode(kind_flags: int, body: bytes) -> Packet:
    """One packet from its first byte and its body (the bytes after the remaining length)."""
    kind, flags = kind_flags >> 4, kind_flags & 0x0F
    if kind != PUBLISH and flags != _FIXED_FLAGS.get(kind, 0):
        raise MalformedPacket(f"packet type {kind} with reserved flags {flags:#x}")
    parser = _PARSERS.get(kind)
    if parser is None:
        raise MalformedPacket(f"packet type {kind} is not sent by a client")
    return parser(flags, _Cursor(body))


class _Cursor:
    """Reads fields off one packet's body; MalformedPacket when the body runs out."""

    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, count: int) -> bytes:
        end = self.at + count
        if end > len(self.data):
            raise MalformedPacket("packet shorter than its fields")
        chunk = self.data[self.at : end]
        self.at = end
        return chunk

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        value: int = struct.unpack(">H", self.take(2))[0]
        return value

    def binary(self) -> bytes:
        return self.take(self.u16())

    def text(self) -> str:
        raw = self.binary()
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedPacket("string is not UTF-8") from None
        if "\x00" in value:
            raise MalformedPacket("string contains U+0000")  # §1.5.3
        return value

    def rest(self) -> bytes:
        chunk = self.data[self.at :]
        self.at = len(self.data)
        return chunk

    def done(self) -> bool:
        return self.at >= len(self.data)

    def end(self) -> None:
        if not self.done():
            raise MalformedPacket("trailing bytes after the packet's fields")


_Parser = Callable[[int, _Cursor], "Packet"]


def _connect(flags: int, cursor: _Cursor) -> Connect:
    name = cursor.binary()
    level = cursor.u8()
    if name not in (b"MQTT", b"MQIsdp"):
        raise MalformedPacket("not an MQTT CONNECT")
    if name != b"MQTT" or level != 4:
        # 3.1 ("MQIsdp", level 3) and 5: the endpoint answers return code 1, not 3.1.1 rules.
        return Connect("", None, None, 0, True, None, level)
    connect_flags = cursor.u8()
    if connect_flags & 0x01:
        raise MalformedPacket("CONNECT reserved flag set")
    keepalive = cursor.u16()
    client_id = cursor.text()
    will: Will | None = None
    will_qos = (connect_flags >> 3) & 0x03
    if connect_flags & 0x04:
        if will_qos > 2:
            raise MalformedPacket("will QoS 3")
        will = Will(cursor.text(), cursor.binary(), will_qos, bool(connect_flags & 0x20))
    elif will_qos or connect_flags & 0x20:
        raise MalformedPacket("will QoS or retain without a will")
    username = cursor.text() if connect_flags & 0x80 else None
    password: str | None = None
    if connect_flags & 0x40:
        if username is None:
            raise MalformedPacket("password without a username")
        raw = cursor.binary()
        password = raw.decode("utf-8", errors="replace")  # binary in 3.1.1; tokens are text
    cursor.end()
    clean = bool(connect_flags & 0x02)
    return Connect(client_id, username, password, keepalive, clean, will, level)


def _publish(flags: int, cursor: _Cursor) -> Publish:
    qos = (flags >> 1) & 0x03
    if qos == 3:
        raise MalformedPacket("PUBLISH with QoS 3")
    topic = cursor.text()
    if not topic or "+" in topic or "#" in topic:
        raise MalformedPacket("PUBLISH topic empty or with a wildcard")
    packet_id = cursor.u16() if qos else None
    if packet_id == 0:
        raise MalformedPacket("packet id 0")
    return Publish(topic, cursor.rest(), qos, bool(flags & 0x01), bool(flags & 0x08), packet_id)


def _ack_parser(kind: int) -> _Parser:
    def parse(flags: int, cursor: _Cursor) -> Ack:
        packet_id = cursor.u16()
        cursor.end()
        return Ack(kind, packet_id)

    return parse


def _subscribe(flags: int, cursor: _Cursor) -> Subscribe:
    packet_id = cursor.u16()
    filters: list[tuple[str, int]] = []
    while not cursor.done():
        topic = cursor.text()
        qos = cursor.u8()
        if qos & 0xFC or not topic:
            raise MalformedPacket("SUBSCRIBE with a bad QoS byte or an empty filter")
        filters.append((topic, qos))
    if not filters:
        raise MalformedPacket("SUBSCRIBE without a filter")
    return Subscribe(packet_id, tuple(filters))


def _unsubscribe(flags: int, cursor: _Cursor) -> Unsubscribe:
    packet_id = cursor.u16()
    filters: list[str] = []
    while not cursor.done():
        filters.append(cursor.text())
    if not filters:
        raise MalformedPacket("UNSUBSCRIBE without a filter")
    return Unsubscribe(packet_id, tuple(filters))


def _simple_parser(kind: int) -> _Parser:
    def parse(flags: int, cursor: _Cursor) -> Simple:
        cursor.end()
        return Simple(kind)

    return parse


_PARSERS: dict[int, _Parser] = {
    CONNECT: _connect,
    PUBLISH: _publish,
    PUBACK: _ack_parser(PUBACK),
    PUBREC: _ack_parser(PUBREC),
    PUBREL: _ack_parser(PUBREL),
    PUBCOMP: _ack_parser(PUBCOMP),
    SUBSCRIBE: _subscribe,
    UNSUBSCRIBE: _unsubscribe,
    PINGREQ: _simple_parser(PINGREQ),
    DISCONNECT: _simple_parser(DISCONNECT),
}


# ---- encoding -------------------------------------------------------------------------------


def remaining_length(size: int) -> bytes:
    """The variable-length encoding of a packet's remaining length (§2.2.3)."""
    out = bytearray()
    while True:
        byte, size = size & 0x7F, size >> 7
        out.append(byte | (0x80 if size else 0))
        if not size:
            return bytes(out)


def _packet(kind_flags: int, body: bytes) -> bytes:
    return bytes([kind_flags]) + remaining_length(len(body)) + body


def _string(value: str) -> bytes:
    data = value.encode()
    return struct.pack(">H", len(data)) + data


def connack(return_code: int, session_present: bool = False) -> bytes:
    """A CONNACK with the given return code (0 accepted)."""
    return bytes([CONNACK << 4, 2, 1 if session_present else 0, return_code])


def publish(topic: str, payload: bytes, *, qos: int = 0, packet_id: int | None = None) -> bytes:
    """A PUBLISH packet; QoS 1 and 2 need a `packet_id` in 1..65535."""
    body = _string(topic)
    if qos:
        assert packet_id is not None and 0 < packet_id < 65536
        body += struct.pack(">H", packet_id)
    return _packet(PUBLISH << 4 | qos << 1, body + payload)


def ack(kind: int, packet_id: int) -> bytes:
    """PUBACK, PUBREC, PUBREL (flags 2) or PUBCOMP; also UNSUBACK."""
    flags = 2 if kind == PUBREL else 0
    return bytes([kind << 4 | flags, 2]) + struct.pack(">H", packet_id)


def suback(packet_id: int, codes: list[int]) -> bytes:
    """A SUBACK granting (or refusing, 0x80) each filter of a SUBSCRIBE in order."""
    return _packet(SUBACK << 4, struct.pack(">H", packet_id) + bytes(codes))


PINGRESP_BYTES = bytes([PINGRESP << 4, 0])
