"""xiaozhi control messages as the device sends and receives them (protocol reference §1-§3).

Pure: no I/O. Builders return compact JSON text, ready for one WebSocket text frame; unlike the
stock firmware every string is JSON-escaped, so odd session ids or wake words stay valid JSON.
"""

import json
import struct

LISTEN_MODES = ("auto", "manual", "realtime")

# Uplink audio parameters the stock firmware announces; the backend's codec setup keys off them.
AUDIO_PARAMS = {"format": "opus", "sample_rate": 16000, "channels": 1, "frame_duration": 60}
# What this firmware announces: it has no Opus codec, so it sends and plays raw PCM16 LE mono.
PCM16_PARAMS = {"format": "pcm16", "sample_rate": 16000, "channels": 1, "frame_duration": 60}
DEFAULT_DOWNLINK_RATE = 24000  # stock default when the server hello names no sample_rate

_COMPACT = (",", ":")


def encode(message) -> str:
    """Compact JSON text, as every device message is sent."""
    return json.dumps(message, separators=_COMPACT)


def device_hello(version=1, transport="websocket", mcp=True, audio_params=AUDIO_PARAMS) -> str:
    return encode(
        {
            "type": "hello",
            "version": version,
            "features": {"mcp": mcp},
            "transport": transport,
            "audio_params": audio_params,
        }
    )


def mcp_envelope(session_id, payload) -> str:
    return encode({"session_id": session_id, "type": "mcp", "payload": payload})


def listen_detect(session_id, text) -> str:
    return encode({"session_id": session_id, "type": "listen", "state": "detect", "text": text})


def listen_start(session_id, mode="auto") -> str:
    if mode not in LISTEN_MODES:
        raise ValueError("listen mode must be one of auto, manual, realtime: " + repr(mode))
    return encode({"session_id": session_id, "type": "listen", "state": "start", "mode": mode})


def listen_stop(session_id) -> str:
    return encode({"session_id": session_id, "type": "listen", "state": "stop"})


def abort(session_id, reason=None) -> str:
    message = {"session_id": session_id, "type": "abort"}
    if reason is not None:
        message["reason"] = reason
    return encode(message)


def pack_audio(version, payload, timestamp=0) -> bytes:
    """One binary audio message in protocol version 1 (raw), 2 or 3 (reference §1.3)."""
    if version == 2:
        return struct.pack(">HHIII", 2, 0, 0, timestamp & 0xFFFFFFFF, len(payload)) + payload
    if version == 3:
        return struct.pack(">BBH", 0, 0, len(payload)) + payload
    return bytes(payload)


def unpack_audio(version, data):
    """The audio payload of a binary message, or None if its header does not fit its size."""
    if version == 2:
        if len(data) < 16 or struct.unpack_from(">I", data, 12)[0] != len(data) - 16:
            return None
        return data[16:]
    if version == 3:
        if len(data) < 4 or struct.unpack_from(">H", data, 2)[0] != len(data) - 4:
            return None
        return data[4:]
    return data


def downlink_audio(hello):
    """(format, sample_rate) the server hello announces for the downlink (stock defaults)."""
    params = hello.get("audio_params") if isinstance(hello, dict) else None
    if not isinstance(params, dict):
        params = {}
    fmt = params.get("format")
    rate = params.get("sample_rate")
    if isinstance(rate, bool) or not isinstance(rate, int) or not 8000 <= rate <= 48000:
        rate = DEFAULT_DOWNLINK_RATE
    return (fmt if isinstance(fmt, str) else "opus"), rate


def parse(text):
    """The message as a dict, or None if it is not a JSON object with a string `type`."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeError:
            return None
    if not isinstance(text, str):
        return None
    try:
        message = json.loads(text)
    except ValueError:
        return None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        return None
    return message


def is_server_hello(msg, transport="websocket") -> bool:
    """True for a server hello the stock firmware would accept on this transport."""
    return (
        isinstance(msg, dict) and msg.get("type") == "hello" and msg.get("transport") == transport
    )


def handshake_headers(token, device_id, client_id, version=1) -> dict:
    """The extra WebSocket upgrade headers of reference §1.1."""
    headers = {
        "Protocol-Version": str(version or 1),
        "Device-Id": device_id,
        "Client-Id": client_id,
    }
    if token:
        headers["Authorization"] = token if " " in token else "Bearer " + token
    return headers


def wifi_signal(rssi) -> str:
    """Stock signal label for a Wi-Fi RSSI in dBm (reference §4.6)."""
    if rssi >= -60:
        return "strong"
    if rssi >= -70:
        return "medium"
    return "weak"


def goodbye(session_id) -> str:
    """Device-initiated end of an MQTT conversation (reference §2.4)."""
    return encode({"session_id": session_id, "type": "goodbye"})
