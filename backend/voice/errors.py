"""Errors of the voice loop (all derive from `backend.errors.BridgeError`)."""

from backend.errors import BridgeError


class VoiceUnavailable(BridgeError):
    """A voice engine cannot run here: a package of the `voice` extra is missing, or its
    library or model failed to load. The message names what is missing."""
