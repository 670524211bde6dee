"""Routes that serve the console: one HTML shell per page (its module builds the rest), and
`/console/<file>` assets.

Every response carries a strict Content-Security-Policy: scripts, styles and connections only
from the bridge's own origin, no inline script, no framing. A page that could be made to run
someone else's script would run it with the operator's key.
"""

import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC_DIR = Path(__file__).parent / "static"
CONSOLE_PREFIX = "/console/"


@dataclass(frozen=True, slots=True)
class Page:
    """One console page: its module (which builds everything, title included, in the reader's
    language) and the style sheets beside style.css."""

    script: str
    styles: tuple[str, ...] = ()


# Path → page: the chat page is the front page.
PAGES: dict[str, Page] = {
    "/": Page("chat.js", ("chat.css",)),
    "/conversations": Page("conversations.js", ("admin.css", "conversations.css")),
    "/settings": Page("settings.js", ("settings.css",)),
    "/devices": Page("devices.js", ("devices.css",)),
    "/talk": Page("talk.js", ("talk.css",)),
    "/mcp-servers": Page("mcp-servers.js", ("admin.css", "fleet.css")),
    "/firmware": Page("firmware.js", ("admin.css", "fleet.css")),
    "/activations": Page("activations.js", ("admin.css",)),
    "/keys": Page("keys.js", ("admin.css",)),
    "/audit": Page("audit.js", ("admin.css",)),
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
        Route(path, _page(page), methods=["GET", "HEAD"]) for path, page in PAGES.items()
    ]
    assets = _SecurityHeaders(StaticFiles(directory=STATIC_DIR))
    return [*pages, Mount(CONSOLE_PREFIX.rstrip("/"), app=assets, name="console")]


def page_html(page: Page) -> str:
    """Every page's shell: the same head, a header and a main for the module to fill."""
    styles = "".join(
        f'<link rel="stylesheet" href="{CONSOLE_PREFIX}{name}">\n'
        for name in ("style.css", *page.styles)
    )
    return (
        "<!doctype html>\n"
        '<html lang="en">\n'
        "<head>\n"
        '<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        "<title>esp32-mcp-bridge</title>\n"
        '<link rel="icon" href="data:,">\n'
        f"{styles}"
        f'<link rel="modulepreload" href="{CONSOLE_PREFIX}common.js">\n'
        f'<script type="module" src="{CONSOLE_PREFIX}{page.script}"></script>\n'
        "</head>\n"
        "<body>\n"
        '<header id="top"></header>\n'
        '<main id="main" tabindex="-1"></main>\n'
        "</body>\n"
        "</html>\n"
    )


def _page(page: Page) -> Callable[[Request], Awaitable[Response]]:
    """One page's shell, with the security headers and an ETag (revalidated on every load)."""
    body = page_html(page).encode()
    etag = f'"{hashlib.sha256(body).hexdigest()[:16]}"'
    headers = {**SECURITY_HEADERS, "ETag": etag}

    async def serve(request: Request) -> Response:
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(body, media_type="text/html; charset=utf-8", headers=headers)

    return serve


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
