"""The bridge's one database (SQLite, or a shared PostgreSQL): versioned migrations per
component, portable SQL, off the event loop."""

from backend.storage.connection import Connection, Cursor, Row
from backend.storage.database import Database, DatabaseError, Migration
from backend.storage.write_behind import WriteBehind

__all__ = ["Connection", "Cursor", "Database", "DatabaseError", "Migration", "Row", "WriteBehind"]
