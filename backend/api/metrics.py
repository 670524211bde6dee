"""`GET /metrics`: the bridge's Prometheus metrics (backend/metrics, docs/metrics.md).

On the admin listener it is a route like the others: the admin token or a key with the scope
`metrics:read` (401 without one, 403 with another key). With `metrics_port` set it is also served
on a listener of its own (on `metrics_host`, loopback by default), behind the same gate unless
`metrics_auth = false`: only there may a scraper come in without a key, and that listener serves
nothing but `/metrics`.
"""

import contextlib
import socket
from typing import Annotated

import structlog
from fastapi import APIRouter, Depends
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend.api.errors import error_body, errors
from backend.api.gate import PRINCIPAL, AdminGate, AsgiApp, KeyResolver
from backend.api.listener import HttpListener, ListenerLimits
from backend.api.scopes import needs
from backend.common import reachable_host, tcp_listener, url_host
from backend.errors import listen_errors
from backend.keys import Principal, Scope
from backend.metrics import REGISTRY

log = structlog.get_logger("metrics")

METRICS_PATH = "/metrics"
Scraper = Annotated[Principal, Depends(needs(Scope.METRICS_READ))]


def exposition() -> Response:
    """Every family in the text format (scrape-time gauges are read now)."""
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def metrics_router() -> APIRouter:
    """The admin listener's route."""
    router = APIRouter(tags=["metrics"])

    @router.get(
        METRICS_PATH,
        response_class=Response,
        responses={
            200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"},
            **errors(401, 403),
        },
    )
    async def metrics(_principal: Scraper) -> Response:
        return exposition()

    return router


def metrics_app(admin_token: str, resolve_key: KeyResolver, *, auth: bool) -> AsgiApp:
    """The dedicated listener's app: `/metrics` only, behind the API's gate unless `auth` is
    off (the operator's explicit choice)."""

    async def metrics(request: Request) -> Response:
        if auth:
            principal = request.scope.get("state", {}).get(PRINCIPAL)
            if not isinstance(principal, Principal) or not principal.has(Scope.METRICS_READ):
                message = f"this key lacks the scope {Scope.METRICS_READ}"
                return JSONResponse(error_body(403, "forbidden", message), status_code=403)
        return exposition()

    async def not_found(request: Request, _exc: Exception) -> Response:
        return JSONResponse(error_body(404, "http_error", "Not Found"), status_code=404)

    app = Starlette(
        routes=[Route(METRICS_PATH, metrics, methods=["GET"])],
        exception_handlers={404: not_found},
    )
    if not auth:
        return app
    return AdminGate(app, admin_token, resolve_key=resolve_key)


class MetricsListener:
    """The optional listener of `metrics_port`."""

    def __init__(self, app: AsgiApp, host: str, port: int, limits: ListenerLimits) -> None:
        self._app = app
        self._host = host
        self._port = port
        self._limits = limits  # head deadline, connection caps (backend/api/listener.py)
        self.listener: HttpListener | None = None
        self._socket: socket.socket | None = None  # bound, until stop()

    @property
    def url(self) -> str:
        """The URL of `/metrics` on this listener."""
        assert self.listener is not None, "metrics listener not started"
        port = self.listener.port
        return f"http://{url_host(reachable_host(self._host))}:{port}{METRICS_PATH}"

    async def start(self) -> None:
        """Bind the listener and serve until `stop`; raises a clear error when the port is taken."""
        with listen_errors("metrics", self._host, self._port, "metrics"):
            sock = self._socket = tcp_listener(self._host, self._port, backlog=128)
        self.listener = HttpListener(self._app, sock, self._limits, "metrics")
        try:
            await self.listener.start("metrics listener")
        except BaseException:
            await self.stop()  # the socket closed, the field cleared: stop() may follow
            raise

    async def stop(self) -> None:
        """Stop serving and close the socket."""
        listener, self.listener = self.listener, None
        if listener is not None:
            # A server that died at startup (uvicorn exits with SystemExit) must not keep the
            # bridge's own stop() from closing everything else.
            with contextlib.suppress(BaseException):
                await listener.stop()
            listener.socket.close()
        if self._socket is not None:
            self._socket.close()
            self._socket = None
