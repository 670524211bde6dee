"""The errors of speech recognition."""

from backend.errors import BridgeError


class RecognitionFailed(BridgeError):
    """A recognizer could not give a transcript (unreachable, timed out, bad answer, crashed)."""


class RecognizerBusy(RecognitionFailed):
    """Too many utterances wait to be recognized: this one is refused at once."""
