"""Binary audio framing of the WebSocket transport (protocol reference §1.3).

One Opus packet per binary message. Version 1 is the raw packet; version 2 has a 16-byte header
(u16 version, u16 type, u32 reserved, u32 timestamp_ms, u32 payload_size); version 3 a 4-byte
header (u8 type, u8 reserved, u16 payload_size). All integers are big-endian. The device trusts
`payload_size`, so encoding always writes the exact size; decoding rejects any mismatch.
"""

import struct
from dataclasses import dataclass

from backend.errors import BridgeError

OPUS = 0
_V2_HEADER = struct.Struct(">HHIII")
_V3_HEADER = struct.Struct(">BBH")
SUPPORTED_VERSIONS = (1, 2, 3)


class AudioFrameError(BridgeError):
    """A binary frame that does not match the negotiated framing version."""


@dataclass(frozen=True, slots=True)
class AudioFrame:
    """One encoded audio packet (Opus unless `type` says otherwise) with its timestamp in ms."""

    payload: bytes
    timestamp_ms: int = 0
    type: int = OPUS


def encode_audio(version: int, payload: bytes, timestamp_ms: int = 0) -> bytes:
    """Frame one audio packet for the device's protocol version."""
    if version == 1:
        return bytes(payload)
    if version == 2:
        header = _V2_HEADER.pack(2, OPUS, 0, timestamp_ms & 0xFFFFFFFF, len(payload))
        return header + payload
    if version == 3:
        if len(payload) > 0xFFFF:
            raise AudioFrameError(f"v3 payload of {len(payload)} bytes exceeds 65535")
        return _V3_HEADER.pack(OPUS, 0, len(payload)) + payload
    raise AudioFrameError(f"unsupported protocol version {version}")


def decode_audio(version: int, data: bytes) -> AudioFrame:
    """Parse one binary message; raises AudioFrameError for a truncated or inconsistent frame."""
    if version == 1:
        return AudioFrame(bytes(data))
    if version == 2:
        return _decode_v2(data)
    if version == 3:
        return _decode_v3(data)
    raise AudioFrameError(f"unsupported protocol version {version}")


def _decode_v2(data: bytes) -> AudioFrame:
    if len(data) < _V2_HEADER.size:
        raise AudioFrameError(f"v2 frame of {len(data)} bytes is shorter than its 16-byte header")
    _version, kind, _reserved, timestamp, size = _V2_HEADER.unpack_from(data)
    payload = data[_V2_HEADER.size :]
    if len(payload) != size:
        raise AudioFrameError(f"v2 payload_size {size} but {len(payload)} bytes follow")
    return AudioFrame(bytes(payload), timestamp, kind)


def _decode_v3(data: bytes) -> AudioFrame:
    if len(data) < _V3_HEADER.size:
        raise AudioFrameError(f"v3 frame of {len(data)} bytes is shorter than its 4-byte header")
    kind, _reserved, size = _V3_HEADER.unpack_from(data)
    payload = data[_V3_HEADER.size :]
    if len(payload) != size:
        raise AudioFrameError(f"v3 payload_size {size} but {len(payload)} bytes follow")
    return AudioFrame(bytes(payload), 0, kind)
