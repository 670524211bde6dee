"""The root of every error the bridge raises on purpose.

Each layer defines its own subclasses next to its code (`backend.mcp_session.errors`,
`backend.devices.errors`, ...); all of them derive from `BridgeError`, so a caller that wants "any
bridge failure" catches one class, and the admin API maps each subclass to one HTTP status and
one `error.code` in a single table (`backend.api.errors`). Every message is one line that is safe
to show to an operator: it never echoes a secret and clips what a device sent.
"""


class BridgeError(Exception):
    """Base class of every error the bridge raises deliberately."""


class MessageTooLarge(BridgeError):
    """A message for a device is larger than the device accepts; it was not sent."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes exceeds the device's limit of {limit} bytes")
        self.size = size
        self.limit = limit
