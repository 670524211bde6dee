"""The bridge's one SQLite database: WAL, versioned migrations per component, off the event loop."""

from backend.storage.database import Database, DatabaseError, Migration

__all__ = ["Database", "DatabaseError", "Migration"]
