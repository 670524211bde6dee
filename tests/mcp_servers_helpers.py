"""Helpers for the external MCP server tests: config entries for the fake SDK server
(tests/fakes/mcp_server.py) over stdio, the same server over Streamable HTTP on loopback (behind
an optional bearer-token check), and waits on a bridge's hub."""

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import uvicorn

from backend.mcp_servers.hub import ExternalServer, ServerState
from backend.server import Bridge
from tests.fakes.mcp_server import build_server

FAKE_SERVER = Path(__file__).parent / "fakes" / "mcp_server.py"
REPO = Path(__file__).parent.parent


def stdio_entry(name: str = "fake", **extra: Any) -> dict[str, Any]:
    """A `[[mcp_servers]]` entry running the fake server over stdio."""
    return {
        "name": name,
        "command": sys.executable,
        "args": [str(FAKE_SERVER), name],
        "cwd": str(REPO),
        "env": {"PYTHONPATH": str(REPO)},
        **extra,
    }


class _RequireBearer:
    """Pure ASGI: HTTP requests without `Authorization: Bearer <token>` get 401."""

    def __init__(self, app: Any, token: str | None) -> None:
        self.app = app
        self.token = token
        self.seen_authorization: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.token is not None:
            presented = dict(scope["headers"]).get(b"authorization", b"")
            self.seen_authorization.append(presented)
            if presented != f"Bearer {self.token}".encode():
                await send({"type": "http.response.start", "status": 401, "headers": []})
                await send({"type": "http.response.body", "body": b"unauthorized"})
                return
        await self.app(scope, receive, send)


class _Quiet(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@contextlib.asynccontextmanager
async def http_mcp_server(
    name: str = "web", *, token: str | None = None
) -> AsyncIterator[tuple[str, _RequireBearer]]:
    """The fake server over Streamable HTTP on 127.0.0.1:<ephemeral>; yields (url, guard)."""
    app = _RequireBearer(build_server(name).streamable_http_app(), token)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _Quiet(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                await task
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}/mcp", app
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        sock.close()


def server_of(bridge: Bridge, name: str) -> ExternalServer:
    found = bridge.mcp_servers.get(name)
    assert found is not None, f"no MCP server {name!r}"
    return found


async def wait_until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 - the hub has no event to wait on
            await asyncio.sleep(0.02)


async def wait_ready(bridge: Bridge, name: str, *, connects: int = 1) -> ExternalServer:
    server = server_of(bridge, name)
    await wait_until(
        lambda: server.state is ServerState.READY and getattr(server, "connects", 1) >= connects
    )
    return server
