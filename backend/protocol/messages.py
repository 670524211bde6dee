"""JSON control messages of the xiaozhi protocol (reference §1.2, §2.2, §3).

Parsing is tolerant, as devices differ: unknown fields are kept (``extra="allow"``), the device's
`session_id` is never required or checked, and anything unusable raises `ParseError` with a reason
that the caller logs once before dropping the frame. The link stays up either way.
"""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from backend.common import excerpt
from backend.errors import BridgeError


class ParseError(BridgeError):
    """A device frame that cannot be used; the message says why, in one line."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    # Stock firmware echoes the server's session_id, other clients send "" or nothing.
    session_id: Any = None


class AudioParams(BaseModel):
    """The `audio_params` of a hello: codec, sample rate, channels, frame duration."""

    model_config = ConfigDict(extra="allow")

    format: str = "opus"
    sample_rate: int = 16000
    channels: int = 1
    frame_duration: int = 60


OPUS_DOWNLINK_RATES = (8000, 12000, 16000, 24000, 48000)
PCM_DOWNLINK_RATE = 16000


def downlink_params(uplink: AudioParams, opus_rate: int, frame_duration: int) -> AudioParams:
    """What the server hello announces to a device with these hello `audio_params`.

    Opus devices get `opus_rate` (24 kHz by default) unless their hello asks for another Opus
    rate with the bridge's `downlink_sample_rate` extension. A PCM16 device (MicroPython has no
    Opus decoder) gets PCM16 at 16 kHz, or the rate it asks for.
    """
    asked = getattr(uplink, "downlink_sample_rate", None)
    asked = asked if isinstance(asked, int) and not isinstance(asked, bool) else None
    if uplink.format == "pcm16":
        rate = asked if asked in (8000, 16000, 24000) else PCM_DOWNLINK_RATE
        return AudioParams(format="pcm16", sample_rate=rate, frame_duration=frame_duration)
    rate = asked if asked in OPUS_DOWNLINK_RATES else opus_rate
    return AudioParams(format="opus", sample_rate=rate, frame_duration=frame_duration)


class Features(BaseModel):
    """The `features` a device announces in its hello (unknown ones are kept)."""

    model_config = ConfigDict(extra="allow")

    mcp: bool = False
    aec: bool = False
    glyph_push: bool = False


# ---- device -> server -------------------------------------------------------------------------


class DeviceHello(_Message):
    """The device's first message: protocol version, transport, audio params, features."""

    # Frozen: devices of one model send the same hello, so one parsed copy serves them all.
    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["hello"]
    version: int = 1
    transport: str = "websocket"
    # Firmware older than 1.6 omits `features`; such devices have no MCP server.
    features: Features = Field(default_factory=Features)
    audio_params: AudioParams = Field(default_factory=AudioParams)


class Listen(_Message):
    """The device's microphone state: `start`/`stop`, or `detect` with the wake word in `text`."""

    type: Literal["listen"]
    state: Literal["start", "stop", "detect"]
    mode: Literal["auto", "manual", "realtime"] | None = None
    text: str | None = None


class Abort(_Message):
    """The device asks to stop the reply it is playing (e.g. the user spoke over it)."""

    type: Literal["abort"]
    reason: str | None = None


class McpEnvelope(_Message):
    """A JSON-RPC message of the device's MCP server, carried in `payload`."""

    type: Literal["mcp"]
    payload: Any


class Goodbye(_Message):
    """The device ends the conversation."""

    type: Literal["goodbye"]


DeviceMessage = Annotated[
    DeviceHello | Listen | Abort | McpEnvelope | Goodbye, Field(discriminator="type")
]
_device_message = TypeAdapter(DeviceMessage)
DEVICE_TYPES = frozenset({"hello", "listen", "abort", "mcp", "goodbye"})


def parse_device_message(text: str | bytes) -> DeviceHello | Listen | Abort | McpEnvelope | Goodbye:
    """Parse one text frame from a device; raises ParseError with a one-line reason."""
    return device_message(decode_device_message(text))


def decode_device_message(text: str | bytes) -> dict[str, Any]:
    """The frame as a JSON object whose `type` is a known device type; raises ParseError.

    The session feeds an `mcp` payload straight from here (every tool reply), so the hot path
    builds no model; everything else goes on to `device_message`.
    """
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ParseError(f"invalid JSON: {exc}") from None
    except RecursionError:
        raise ParseError("JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ParseError(f"expected a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    if not isinstance(kind, str):
        raise ParseError("message has no string 'type'")
    if kind not in DEVICE_TYPES:
        raise ParseError(f"unknown message type {excerpt(kind)!r}")  # the reason is logged
    return data


def device_message(
    data: dict[str, Any],
) -> DeviceHello | Listen | Abort | McpEnvelope | Goodbye:
    """The typed message of a `decode_device_message` result; raises ParseError."""
    kind = data["type"]
    if kind == "mcp":
        return _parse_mcp(data)
    if kind == "hello":
        return _shared_hello(data)
    try:
        return _device_message.validate_python(data)
    except ValidationError as exc:
        raise ParseError(f"invalid {kind!r} message: {_first_error(exc)}") from None


_HELLOS: dict[str, DeviceHello] = {}
_HELLOS_MAX = 256


def _shared_hello(data: dict[str, Any]) -> DeviceHello:
    """One parsed (frozen) hello per distinct hello: a fleet of one model shares it."""
    key = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    hello = _HELLOS.get(key)
    if hello is None:
        try:
            hello = DeviceHello.model_validate(data)
        except ValidationError as exc:
            raise ParseError(f"invalid 'hello' message: {_first_error(exc)}") from None
        if len(_HELLOS) >= _HELLOS_MAX:
            _HELLOS.clear()
        _HELLOS[key] = hello
    return hello


def _parse_mcp(data: dict[str, Any]) -> McpEnvelope:
    # Hot path of every tool call: skip model validation, the payload is any JSON value and the
    # MCP session checks it.
    if "payload" not in data:
        raise ParseError("invalid 'mcp' message: missing 'payload'")
    return McpEnvelope.model_construct(**data)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in error["loc"]) or "message"
    return f"{where}: {error['msg']}"


# ---- server -> device -------------------------------------------------------------------------


class _ServerMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


class ServerHello(_ServerMessage):
    """The bridge's hello reply: the session id and the audio format it sends."""

    type: Literal["hello"] = "hello"
    # Must be present and exactly "websocket": a missing transport crashes stock firmware.
    transport: Literal["websocket", "udp"] = "websocket"
    session_id: str
    audio_params: AudioParams = Field(default_factory=lambda: AudioParams(sample_rate=24000))


class Stt(_ServerMessage):
    """What the bridge heard the user say, shown on the device."""

    type: Literal["stt"] = "stt"
    session_id: str | None = None
    text: str


class Tts(_ServerMessage):
    """Speech playback state: `start`, each `sentence_start` with its text, `stop`."""

    type: Literal["tts"] = "tts"
    session_id: str | None = None
    state: Literal["start", "sentence_start", "stop"]
    text: str | None = None


class Llm(_ServerMessage):
    """The reply's emotion (the device shows a matching face), optionally with text."""

    type: Literal["llm"] = "llm"
    session_id: str | None = None
    emotion: str
    text: str | None = None


class System(_ServerMessage):
    """A system command to the device (e.g. `reboot`)."""

    type: Literal["system"] = "system"
    session_id: str | None = None
    command: str


class Alert(_ServerMessage):
    """An alert the device shows: status line, message and emotion."""

    type: Literal["alert"] = "alert"
    session_id: str | None = None
    status: str
    message: str
    emotion: str


class ServerGoodbye(_ServerMessage):
    """Ends a conversation on MQTT; since firmware 2.2.6 `session_id` must be the current one."""

    type: Literal["goodbye"] = "goodbye"
    session_id: str


ServerMessage = ServerHello | Stt | Tts | Llm | System | Alert | ServerGoodbye


# Built once: `json.dumps` with options builds a new encoder on every call (every tool call).
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def mcp_envelope(session_id: str, payload: Any) -> str:
    """Serialise one JSON-RPC payload for the device, compact as the firmware sends it."""
    return _COMPACT.encode({"session_id": session_id, "type": "mcp", "payload": payload})
