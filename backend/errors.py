"""The root of every error the bridge raises on purpose.

Each layer defines its own subclasses next to its code (`backend.mcp_session.errors`,
`backend.devices.errors`, ...); all of them derive from `BridgeError`, so a caller that wants "any
bridge failure" catches one class, and the admin API maps each subclass to one HTTP status and
one `error.code` in a single table (`backend.api.errors`). Every message is one line that is safe
to show to an operator: it never echoes a secret and clips what a device sent.
"""

import contextlib
import os
from collections.abc import Iterator


class BridgeError(Exception):
    """Base class of every error the bridge raises deliberately."""


class MessageTooLarge(BridgeError):
    """A message for a device is larger than the device accepts; it was not sent."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of {size} bytes exceeds the device's limit of {limit} bytes")
        self.size = size
        self.limit = limit


class ListenError(BridgeError):
    """A listener could not bind its address. `setting` is the prefix of the settings that move
    it (`ws` for ws_host and ws_port), so a command line can name its flag; a raw "[Errno 98]
    Address already in use" names neither the port nor what it was for."""

    def __init__(self, what: str, host: str, port: int, setting: str, reason: str) -> None:
        super().__init__(f"cannot listen for {what} on {host}:{port}: {reason}")
        self.what = what
        self.host = host
        self.port = port
        self.setting = setting
        self.reason = reason


@contextlib.contextmanager
def listen_errors(what: str, host: str, port: int, setting: str) -> Iterator[None]:
    """An OSError while binding `host:port` becomes a `ListenError` naming it."""
    try:
        yield
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ListenError(what, host, port, setting, reason.lower()) from exc
