"""The errors of the chat pipeline: conversations not found or misnamed, a model service that
refused or is unreachable. All are `BridgeError`s."""

from backend.errors import BridgeError

MAX_ID_LENGTH = 128  # the longest conversation id (memory.py checks ids against it)


class ConversationNotFound(BridgeError):
    """No stored conversation has this id."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"no conversation {conversation_id[:MAX_ID_LENGTH]!r}")
        self.conversation_id = conversation_id


class InvalidConversationId(BridgeError):
    """A conversation id that is not 1 to `MAX_ID_LENGTH` ASCII letters, digits or `._:@-`."""

    pass


class LlmError(BridgeError):
    """The model service refused or garbled a request (4xx, unreadable reply).

    Its text is a short reason fit for a turn's `offline_reason` ("ollama unreachable at
    http://localhost:11434"); `detail` is what the transport said ("ConnectError: All connection
    attempts failed"), for the log only. `reported`: the provider logged it already (a service
    that stays down is logged once when it goes down, not by every turn that finds it down).
    """

    detail: str | None = None
    reported: bool = False


class LlmUnavailable(LlmError):
    """The model service cannot be reached: connection refused, timeout, 5xx. Offline mode."""
