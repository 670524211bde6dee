"""Admin HTTP API (FastAPI), served in the bridge's own event loop."""

from backend.api.app import create_app

__all__ = ["create_app"]
