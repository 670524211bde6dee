"""Routes that serve the console: one HTML file per page, and `/console/<file>` assets.

Every response carries a strict Content-Security-Policy: scripts, styles and connections only
from the bridge's own origin, no inline script, no framing. A page that could be made to run
someone else's script would run it with the operator's key.
"""

from collections.abc import Awaitable, Callable
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC_DIR = Path(__file__).parent / "static"
CONSOLE_PREFIX = "/console/"
# Path → file: the chat page is the front page, as the seed's index.html was.
PAGES: dict[str, str] = {
    "/": "index.html",
    "/settings": "settings.html",
    "/devices": "devices.html",
    "/talk": "talk.html",
    "/keys": "keys.html",
    "/activations": "activations.html",
    "/audit": "audit.html",
    "/firmware": "firmware.html",
    "/mcp-servers": "mcp-servers.html",
    "/conversations": "conversations.html",
}
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "media-src 'self' blob:",
        "connect-src 'self'",
        "worker-src 'self' blob:",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS: dict[str, str] = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # The microphone is for the talk page of this origin only; nothing else is asked for.
    "Permissions-Policy": "microphone=(self), camera=(), geolocation=()",
    # Revalidated on every load (ETag): an upgraded bridge never serves a stale script.
    "Cache-Control": "no-cache",
}


def console_routes() -> list[BaseRoute]:
    """The pages and the asset mount, in the order the app should try them."""
    pages: list[BaseRoute] = [
        Route(path, _page(name), methods=["GET", "HEAD"]) for path, name in PAGES.items()
    ]
    assets = _SecurityHeaders(StaticFiles(directory=STATIC_DIR))
    return [*pages, Mount(CONSOLE_PREFIX.rstrip("/"), app=assets, name="console")]


def _page(name: str) -> Callable[[Request], Awaitable[Response]]:
    """One HTML page, with the security headers."""
    path = STATIC_DIR / name

    async def page(request: Request) -> Response:
        return FileResponse(path, media_type="text/html", headers=SECURITY_HEADERS)

    return page


class _SecurityHeaders:
    """Adds the security headers to every response of the wrapped app."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._raw = [(k.lower().encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k for k, _ in self._raw}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message["headers"] = kept + self._raw
            await send(message)

        await self._app(scope, receive, with_headers)
