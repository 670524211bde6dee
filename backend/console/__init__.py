"""The web console: static pages served by the bridge on its admin HTTP listener.

The pages hold no data and need no key to load; everything they show comes from the API with
the key the user pastes (kept in the browser's session storage), so what a page shows and
allows follows that key's scopes (docs/console.md).
"""

from backend.console.routes import CONSOLE_PREFIX, PAGES, console_routes

__all__ = ["CONSOLE_PREFIX", "PAGES", "console_routes"]
