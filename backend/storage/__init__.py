"""The bridge's one SQLite database: WAL, versioned migrations per component, off the event loop."""

from backend.storage.database import Database, DatabaseError, Migration
from backend.storage.write_behind import WriteBehind

__all__ = ["Database", "DatabaseError", "Migration", "WriteBehind"]
