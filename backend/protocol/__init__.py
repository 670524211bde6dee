"""The xiaozhi wire protocol: JSON control messages and binary audio framing (no I/O)."""

from backend.protocol.audio import AudioFrame, AudioFrameError, decode_audio, encode_audio
from backend.protocol.messages import (
    Abort,
    Alert,
    AudioParams,
    DeviceHello,
    DeviceMessage,
    Goodbye,
    Listen,
    Llm,
    McpEnvelope,
    ParseError,
    ServerHello,
    Stt,
    System,
    Tts,
    parse_device_message,
)

__all__ = [
    "Abort",
    "Alert",
    "AudioFrame",
    "AudioFrameError",
    "AudioParams",
    "DeviceHello",
    "DeviceMessage",
    "Goodbye",
    "Listen",
    "Llm",
    "McpEnvelope",
    "ParseError",
    "ServerHello",
    "Stt",
    "System",
    "Tts",
    "decode_audio",
    "encode_audio",
    "parse_device_message",
]
