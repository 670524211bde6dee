"""The UDP audio channel of the MQTT transport (protocol reference §2.2-2.3).

Packet (both directions), all integers big-endian:

    0 u8 type = 0x01 | 1 u8 flags | 2 u16 payload_len | 4 u32 ssrc | 8 u32 timestamp
    12 u32 sequence | 16 AES-128-CTR ciphertext of one Opus packet (payload_len bytes)

The 16-byte header is the initial counter block of AES-128-CTR. The device builds its uplink
header from the server's `nonce` with bytes 2-3, 8-11 and 12-15 overwritten, so bytes 0-1 and 4-7
are the nonce's: byte 0 is `0x01` and bytes 4-7 carry a per-session cookie, which is how one
socket tells the sessions apart. There is no authentication tag: every check (length, type,
cookie, sequence) runs before anything is decrypted, and a datagram that fails one is dropped and
counted, never raised. A forged datagram with a live cookie but a wrong key cannot be recognised
(it decrypts to noise); a stale key comes with a stale nonce, whose cookie is unknown.

The codec functions are pure (bytes in, bytes out) for tests; `UdpAudioChannel` is the one
asyncio datagram endpoint that all sessions share.
"""

import asyncio
import os
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import structlog
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from backend.errors import BridgeError
from backend.logs import EventBudget
from backend.protocol.audio import AudioFrame

log = structlog.get_logger("transport.udp")

PACKET_TYPE = 0x01
HEADER = struct.Struct(">BBHIII")  # type, flags, payload_len, ssrc, timestamp, sequence
HEADER_SIZE = HEADER.size  # 16
KEY_SIZE = 16
DEFAULT_MAX_PAYLOAD = 1500  # a 60 ms Opus packet is far smaller; one Ethernet MTU is plenty
MAX_SEQUENCE_JUMP = 1 << 16  # ~65 minutes of 60 ms frames lost in a row: not a live device
_U32 = 0xFFFFFFFF
_U128 = (1 << 128) - 1

Address = tuple[str, int]
AudioSink = Callable[[AudioFrame], None]


class DropReason(StrEnum):
    """Why a datagram was not delivered (the `drop_<reason>` counters)."""

    SHORT = "short"  # shorter than the 16-byte header
    BAD_TYPE = "bad_type"  # byte 0 is not 0x01
    OVERSIZED = "oversized"  # payload_len above the bound
    BAD_LENGTH = "bad_length"  # datagram length != 16 + payload_len (truncated or padded)
    UNKNOWN_COOKIE = "unknown_cookie"  # no live session has this ssrc
    REPLAY = "replay"  # sequence not above the last accepted one
    SEQUENCE_JUMP = "sequence_jump"  # more than MAX_SEQUENCE_JUMP above the last accepted one
    HANDLER_ERROR = "handler_error"  # the session's audio sink raised
    NO_PEER = "no_peer"  # downlink before any valid uplink taught us the address
    SEND_ERROR = "send_error"  # the socket refused a downlink datagram


class PacketError(BridgeError, ValueError):
    """A datagram that is not a well-formed packet; `reason` says which rule it broke."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class UdpError(BridgeError):
    """The UDP channel cannot do what was asked (not started, bad parameters)."""


@dataclass(frozen=True, slots=True)
class PacketHeader:
    type: int
    flags: int
    payload_len: int
    ssrc: int
    timestamp: int
    sequence: int


# ---- pure codec ---------------------------------------------------------------------------------


def new_key() -> bytes:
    return secrets.token_bytes(KEY_SIZE)


def new_nonce(cookie: int) -> bytes:
    """The hello `nonce`: 0x01 in byte 0, the session cookie in bytes 4-7, the rest zero."""
    if not 0 <= cookie <= _U32:
        raise UdpError("cookie must fit in 32 bits")
    return HEADER.pack(PACKET_TYPE, 0, 0, cookie, 0, 0)


def cookie_of(nonce: bytes) -> int:
    return int.from_bytes(nonce[4:8], "big")


def build_header(nonce: bytes, payload_len: int, timestamp: int, sequence: int) -> bytes:
    """The device's rule: the nonce with payload_len (2-3), timestamp (8-11), sequence (12-15)."""
    if len(nonce) != HEADER_SIZE:
        raise UdpError("nonce must be 16 bytes")
    if not 0 <= payload_len <= 0xFFFF:
        raise UdpError(f"payload of {payload_len} bytes does not fit the u16 length")
    return b"".join(
        (
            nonce[0:2],
            payload_len.to_bytes(2, "big"),
            nonce[4:8],
            (timestamp & _U32).to_bytes(4, "big"),
            (sequence & _U32).to_bytes(4, "big"),
        )
    )


def ctr_xor(key: bytes, header: bytes, data: bytes) -> bytes:
    """AES-128-CTR with `header` as the initial counter block (encrypts and decrypts)."""
    cipher = Cipher(algorithms.AES(key), modes.CTR(header)).encryptor()
    return cipher.update(data) + cipher.finalize()


class CtrKeystream:
    """AES-128-CTR for one key, fast: one reusable AES-ECB context encrypts the counter blocks.

    Same output as `ctr_xor` (a test checks it against `modes.CTR`), without building a new
    cipher context for every datagram, which costs more than the decryption itself.
    """

    __slots__ = ("_ecb",)

    def __init__(self, key: bytes) -> None:
        self._ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()

    def xor(self, header: bytes, data: bytes) -> bytes:
        size = len(data)
        if not size:
            return b""
        start = int.from_bytes(header, "big")
        blocks = b"".join(
            ((start + index) & _U128).to_bytes(16, "big") for index in range((size + 15) // 16)
        )
        stream = self._ecb.update(blocks)
        return (int.from_bytes(stream[:size], "big") ^ int.from_bytes(data, "big")).to_bytes(
            size, "big"
        )


def seal(key: bytes, nonce: bytes, payload: bytes, timestamp: int, sequence: int) -> bytes:
    """One datagram as a device (or the bridge) sends it."""
    header = build_header(nonce, len(payload), timestamp, sequence)
    return header + ctr_xor(key, header, payload)


def parse_header(datagram: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> PacketHeader:
    """The header of a datagram after the structural checks; PacketError otherwise."""
    size = len(datagram)
    if size < HEADER_SIZE:
        raise PacketError(DropReason.SHORT, f"{size} bytes, shorter than the header")
    kind, flags, payload_len, ssrc, timestamp, sequence = HEADER.unpack_from(datagram)
    if kind != PACKET_TYPE:
        raise PacketError(DropReason.BAD_TYPE, f"type byte 0x{kind:02x}")
    if payload_len > max_payload:
        raise PacketError(DropReason.OVERSIZED, f"payload_len {payload_len} > {max_payload}")
    if size != HEADER_SIZE + payload_len:
        raise PacketError(
            DropReason.BAD_LENGTH, f"payload_len {payload_len} but {size - HEADER_SIZE} follow"
        )
    return PacketHeader(kind, flags, payload_len, ssrc, timestamp, sequence)


def open_packet(
    key: bytes, datagram: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> tuple[PacketHeader, bytes]:
    """Header and decrypted payload of one datagram; PacketError if malformed."""
    header = parse_header(datagram, max_payload)
    return header, ctr_xor(key, datagram[:HEADER_SIZE], datagram[HEADER_SIZE:])


# ---- sessions and the endpoint ------------------------------------------------------------------


class UdpSession:
    """One audio channel: key, nonce (cookie), learned peer, sequence state, audio sink."""

    __slots__ = (
        "_ctr",
        "accepted",
        "closed",
        "cookie",
        "device_id",
        "downlink_seq",
        "drops",
        "key",
        "last_uplink_seq",
        "nonce",
        "on_audio",
        "peer",
        "session_id",
    )

    def __init__(
        self, device_id: str, session_id: str, cookie: int, key: bytes, on_audio: AudioSink
    ) -> None:
        self.device_id = device_id
        self.session_id = session_id
        self.cookie = cookie
        self.key = key
        self.nonce = new_nonce(cookie)
        self.on_audio = on_audio
        self.peer: Address | None = None
        self.last_uplink_seq = 0  # the device's first packet after a hello is sequence 1
        self.downlink_seq = 0
        self.accepted = 0
        self.closed = False
        self._ctr = CtrKeystream(key)
        self.drops = _drop_log(log.bind(device_id=device_id, session_id=session_id))

    def hello_block(self, server: str, port: int) -> dict[str, object]:
        """The `udp` object of the server hello (key and nonce as 32 hex digits)."""
        return {"server": server, "port": port, "key": self.key.hex(), "nonce": self.nonce.hex()}

    def accept(
        self, datagram: bytes, header: PacketHeader, source: Address
    ) -> AudioFrame | DropReason:
        """Sequence rule, address learning and decryption for a structurally valid datagram;
        the reason when the sequence rule drops it."""
        if header.sequence <= self.last_uplink_seq:
            self.drops.hit(
                DropReason.REPLAY, detail=f"sequence {header.sequence} <= {self.last_uplink_seq}"
            )
            return DropReason.REPLAY
        if header.sequence - self.last_uplink_seq > MAX_SEQUENCE_JUMP:
            # The header is not authenticated (§2.3): without this bound one forged datagram
            # with sequence 0xFFFFFFFF would make every later uplink of the device a "replay".
            self.drops.hit(
                DropReason.SEQUENCE_JUMP,
                detail=f"sequence {header.sequence} after {self.last_uplink_seq}",
            )
            return DropReason.SEQUENCE_JUMP
        self.last_uplink_seq = header.sequence
        self.peer = source
        self.accepted += 1
        payload = self._ctr.xor(datagram[:HEADER_SIZE], datagram[HEADER_SIZE:])
        return AudioFrame(payload, header.timestamp)

    def seal_downlink(self, frame: AudioFrame) -> bytes:
        """Encrypt one downlink packet with the next sequence number (first is 1)."""
        self.downlink_seq += 1
        header = build_header(self.nonce, len(frame.payload), frame.timestamp_ms, self.downlink_seq)
        return header + self._ctr.xor(header, frame.payload)


def _drop_log(logger: structlog.typing.FilteringBoundLogger) -> EventBudget:
    return EventBudget(logger, "udp datagram dropped", first=3, summary_interval_s=60.0)


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, channel: "UdpAudioChannel") -> None:
        self.channel = channel

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.channel.handle_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable for an earlier downlink (device gone): nothing to do.
        self.channel.count("icmp_errors")


class UdpAudioChannel:
    """One datagram endpoint for every UDP audio session, demultiplexed by cookie."""

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 8884,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        if not 0 < max_payload <= 0xFFFF:
            raise UdpError("max_payload must be within 1..65535")
        self.host = host
        self._port = port
        self.max_payload = max_payload
        self.counters: dict[str, int] = {}
        self._sessions: dict[int, UdpSession] = {}
        self._transport: asyncio.DatagramTransport | None = None
        self._global_drops = _drop_log(log.bind(device_id=None))

    # -- lifecycle --

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        transport, _protocol = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=(self.host, self._port)
        )
        self._transport = transport
        self._port = transport.get_extra_info("sockname")[1]
        log.info("udp audio channel listening", host=self.host, port=self._port)

    async def stop(self) -> None:
        for session in list(self._sessions.values()):
            self.close_session(session)
        self._global_drops.flush()
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    @property
    def port(self) -> int:
        return self._port

    @property
    def running(self) -> bool:
        return self._transport is not None

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + amount

    def stats(self) -> dict[str, int]:
        return {**self.counters, "sessions": len(self._sessions)}

    # -- sessions --

    def open_session(self, device_id: str, session_id: str, on_audio: AudioSink) -> UdpSession:
        """A new session with a fresh key and an unused cookie."""
        while True:
            cookie = int.from_bytes(os.urandom(4), "big")
            if cookie and cookie not in self._sessions:
                break
        session = UdpSession(device_id, session_id, cookie, new_key(), on_audio)
        self._sessions[cookie] = session
        self.count("sessions_opened")
        return session

    def close_session(self, session: UdpSession) -> None:
        """Forget a session (idempotent); later datagrams with its cookie are unknown."""
        if session.closed:
            return
        session.closed = True
        if self._sessions.get(session.cookie) is session:
            del self._sessions[session.cookie]
        session.drops.flush()
        self.count("sessions_closed")

    def session(self, cookie: int) -> UdpSession | None:
        return self._sessions.get(cookie)

    # -- uplink (hot path) --

    def handle_datagram(self, data: bytes, source: Address) -> None:
        """Validate, route and decrypt one datagram; drops are counted, never raised."""
        self.count("rx_datagrams")
        try:
            header = parse_header(data, self.max_payload)
        except PacketError as exc:
            self._drop(exc.reason, str(exc), self._attribute(data))
            return
        session = self._sessions.get(header.ssrc)
        if session is None:
            self._drop(DropReason.UNKNOWN_COOKIE, f"cookie {header.ssrc:08x} from {source[0]}")
            return
        frame = session.accept(data, header, source)
        if isinstance(frame, DropReason):
            self.count(f"drop_{frame}")
            return
        self.count("rx_audio")
        try:
            session.on_audio(frame)
        except Exception as exc:  # a faulty sink must not stop the endpoint
            self._drop(DropReason.HANDLER_ERROR, f"{type(exc).__name__}: {exc}", session)

    def _attribute(self, data: bytes) -> UdpSession | None:
        if len(data) >= 8:
            return self._sessions.get(int.from_bytes(data[4:8], "big"))
        return None

    def _drop(self, reason: DropReason, detail: str, session: UdpSession | None = None) -> None:
        self.count(f"drop_{reason}")
        (session.drops if session is not None else self._global_drops).hit(reason, detail=detail)

    # -- downlink --

    def send(self, session: UdpSession, frame: AudioFrame) -> bool:
        """Send one Opus packet to the session's latest uplink address; False if dropped."""
        if self._transport is None or session.closed:
            raise UdpError("udp session is closed")
        if len(frame.payload) > self.max_payload:
            self._drop(DropReason.OVERSIZED, f"downlink of {len(frame.payload)} bytes", session)
            return False
        if session.peer is None:
            self._drop(DropReason.NO_PEER, "no uplink received yet", session)
            return False
        datagram = session.seal_downlink(frame)
        try:
            self._transport.sendto(datagram, session.peer)
        except OSError as exc:
            self._drop(DropReason.SEND_ERROR, str(exc), session)
            return False
        self.count("tx_audio")
        return True
