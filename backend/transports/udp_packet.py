"""The UDP audio packet of the MQTT transport, sans I/O (protocol reference §2.2-2.3): the
header, AES-128-CTR with the header as its counter block, the structural checks a datagram
passes before anything is decrypted, and the plausibility of an Opus packet (RFC 6716 §3.4).
Bytes in, bytes out; `backend.transports.udp` runs the sessions and the socket.

Packet (both directions), all integers big-endian:

    0 u8 type = 0x01 | 1 u8 flags | 2 u16 payload_len | 4 u32 ssrc | 8 u32 timestamp
    12 u32 sequence | 16 AES-128-CTR ciphertext of one Opus packet (payload_len bytes)
"""

import secrets
import struct
from dataclasses import dataclass
from enum import StrEnum

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from backend.transports.errors import PacketError, UdpError

PACKET_TYPE = 0x01
HEADER = struct.Struct(">BBHIII")  # type, flags, payload_len, ssrc, timestamp, sequence
HEADER_SIZE = HEADER.size  # 16
KEY_SIZE = 16
DEFAULT_MAX_PAYLOAD = 1500  # a 60 ms Opus packet is far smaller; one Ethernet MTU is plenty
MAX_OPUS_FRAME = 1275  # RFC 6716 §3.4 R2
MAX_OPUS_PACKET_MS = 120.0  # RFC 6716 §3.4 R5
_U32 = 0xFFFFFFFF
_U128 = (1 << 128) - 1


class DropReason(StrEnum):
    """Why a datagram was not delivered (the `drop_<reason>` counters)."""

    SHORT = "short"  # shorter than the 16-byte header
    BAD_TYPE = "bad_type"  # byte 0 is not 0x01
    OVERSIZED = "oversized"  # payload_len above the bound
    BAD_LENGTH = "bad_length"  # datagram length != 16 + payload_len (truncated or padded)
    UNKNOWN_COOKIE = "unknown_cookie"  # no live session has this ssrc
    LATE_START = "late_start"  # a session's first uplink with a sequence far from 1
    UNCONFIRMED_RATE = "unconfirmed_rate"  # more than a device sends, from an unconfirmed peer
    REPLAY = "replay"  # sequence not above the last accepted one
    SEQUENCE_JUMP = "sequence_jump"  # more than MAX_SEQUENCE_JUMP above the last accepted one
    IMPLAUSIBLE = "implausible"  # from a new address, and not a frame of the device's stream
    SOURCE_BUDGET = "source_budget"  # its source address spent its budget for bad datagrams
    HANDLER_ERROR = "handler_error"  # the session's audio sink raised
    NO_PEER = "no_peer"  # downlink before any valid uplink taught us the address
    SEND_ERROR = "send_error"  # the socket refused a downlink datagram


@dataclass(frozen=True, slots=True)
class PacketHeader:
    """The 16-byte header of a UDP audio packet, which is also its AES-CTR counter block."""

    type: int
    flags: int
    payload_len: int
    ssrc: int
    timestamp: int
    sequence: int


# ---- pure codec ---------------------------------------------------------------------------------


def new_key() -> bytes:
    """A fresh random AES-128 key for one UDP session."""
    return secrets.token_bytes(KEY_SIZE)


def new_nonce(cookie: int) -> bytes:
    """The hello `nonce`: 0x01 in byte 0, the session cookie in bytes 4-7, the rest zero."""
    if not 0 <= cookie <= _U32:
        raise UdpError("cookie must fit in 32 bits")
    return HEADER.pack(PACKET_TYPE, 0, 0, cookie, 0, 0)


def cookie_of(nonce: bytes) -> int:
    """The session cookie carried in bytes 4-7 of a nonce or header."""
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
        """Encrypt or decrypt `data` with the counter starting at `header`."""
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


# ---- Opus plausibility (RFC 6716 §3.4, written from the RFC) ---------------------------------

_SILK_MS = (10.0, 20.0, 40.0, 60.0)
_HYBRID_MS = (10.0, 20.0)
_CELT_MS = (2.5, 5.0, 10.0, 20.0)


def opus_frame_ms(toc: int) -> float:
    """The duration of each frame of a packet, from the configuration in its TOC byte."""
    config = toc >> 3
    if config < 12:
        return _SILK_MS[config % 4]
    if config < 16:
        return _HYBRID_MS[config % 2]
    return _CELT_MS[config % 4]


def _frame_length(packet: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """A coded frame length at `pos` (1 or 2 bytes) and the position after it."""
    if pos >= end:
        return None
    first = packet[pos]
    if first < 252:
        return first, pos + 1
    if pos + 1 >= end:
        return None
    return first + 4 * packet[pos + 1], pos + 2


def _code3_ok(packet: bytes) -> bool:
    size = len(packet)
    if size < 2:
        return False
    count_byte = packet[1]
    count = count_byte & 0x3F
    if count == 0 or count * opus_frame_ms(packet[0]) > MAX_OPUS_PACKET_MS:
        return False
    pos, end = 2, size
    if count_byte & 0x40:  # padding: length bytes, 255 meaning 254 and one more byte
        while True:
            if pos >= end:
                return False
            value = packet[pos]
            pos += 1
            end -= 254 if value == 255 else value
            if value != 255:
                break
    if count_byte & 0x80:  # VBR: count - 1 coded lengths, the last frame takes the rest
        total = 0
        for _ in range(count - 1):
            read = _frame_length(packet, pos, end)
            if read is None:
                return False
            length, pos = read
            total += length
        last = end - pos - total
        return 0 <= last <= MAX_OPUS_FRAME
    rest = end - pos
    return rest >= 0 and rest % count == 0 and rest // count <= MAX_OPUS_FRAME


def opus_packet_ok(packet: bytes) -> bool:
    """Whether `packet` is a well-formed Opus packet (RFC 6716 §3.4, rules R1-R7).

    About half of all random byte strings pass; what makes noise stand out is the TOC byte,
    which a device's encoder keeps from packet to packet (see `UdpSession`)."""
    size = len(packet)
    if size < 1:
        return False
    code = packet[0] & 0x03
    body = size - 1
    if code == 0:
        return body <= MAX_OPUS_FRAME
    if code == 1:
        return body % 2 == 0 and body // 2 <= MAX_OPUS_FRAME
    if code == 2:
        read = _frame_length(packet, 1, size)
        if read is None:
            return False
        first, pos = read
        return 0 <= size - pos - first <= MAX_OPUS_FRAME
    return _code3_ok(packet)
