"""Errors of the voice loop (all derive from `backend.errors.BridgeError`)."""

from backend.errors import BridgeError


class VoiceUnavailable(BridgeError):
    """A voice engine cannot run here: a package of the `voice` extra is missing, or its
    library or model failed to load. The message names what is missing."""


class AudioDecodeError(BridgeError):
    """An uplink packet that does not decode (garbage Opus, odd PCM length, oversized)."""


class SpeechFailed(BridgeError):
    """A remote speech provider failed: unreachable, an HTTP error, a timeout, or a body that
    is not the audio asked for. The message is safe to log (it never holds the API key)."""
