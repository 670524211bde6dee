"""The one error of the storage package."""

from backend.errors import BridgeError


class DatabaseError(BridgeError):
    """The database cannot be opened or used; the message says why in one line."""
