"""The bridge process: device endpoint and admin API in one event loop, stopped gracefully."""

import asyncio
import contextlib
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog
import uvicorn

from backend.api import create_app
from backend.auth import Tokens, ensure_tokens
from backend.config import Settings
from backend.devices import DeviceRegistry
from backend.devices.session import DeviceSession
from backend.transports.websocket import SHUTDOWN, WebSocketLink, WebSocketTransport

log = structlog.get_logger("bridge")

RUNTIME_FILE = "bridge.json"


class _ApiServer(uvicorn.Server):
    """uvicorn without its own signal handling: the bridge owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Bridge:
    """Starts the WebSocket device endpoint and the admin API; `stop()` drains both."""

    def __init__(self, settings: Settings, tokens: Tokens | None = None) -> None:
        self.settings = settings
        self.tokens = tokens or ensure_tokens(settings)
        self.registry = DeviceRegistry()
        self.devices = WebSocketTransport(settings, self.tokens.device, self._new_session)
        self.app = create_app(self.registry, self.tokens.admin)
        self._api: _ApiServer | None = None
        self._api_task: asyncio.Task[None] | None = None
        self._api_socket: socket.socket | None = None
        self._stopped = asyncio.Event()

    def _new_session(self, link: WebSocketLink) -> DeviceSession:
        return DeviceSession(link, self.registry, self.settings)

    @property
    def ws_port(self) -> int:
        return self.devices.port

    @property
    def http_port(self) -> int:
        assert self._api_socket is not None, "bridge not started"
        return self._api_socket.getsockname()[1]

    @property
    def ws_url(self) -> str:
        host = (
            "127.0.0.1" if self.settings.ws_host in ("0.0.0.0", "::", "") else self.settings.ws_host
        )
        return f"ws://{host}:{self.ws_port}{self.settings.ws_path}"

    @property
    def api_url(self) -> str:
        return f"http://{self.settings.http_host}:{self.http_port}"

    async def start(self) -> None:
        await self.devices.start()
        self._api_socket = _bind(self.settings.http_host, self.settings.http_port)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off")
        self._api = _ApiServer(config)
        self._api_task = asyncio.create_task(self._api.serve(sockets=[self._api_socket]))
        while not self._api.started:
            if self._api_task.done():
                await self._api_task  # surfaces the startup error
                raise RuntimeError("admin API stopped during startup")
            await asyncio.sleep(0.01)
        self._write_runtime_file()
        log.info("bridge listening", devices=self.ws_url, api=self.api_url)

    async def stop(self) -> None:
        """Close devices with 1001 (their pending calls fail), then drain the admin API."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("bridge stopping", devices=len(self.registry))
        for device in self.registry:
            device.mcp.close(SHUTDOWN)
        await self.devices.stop()
        if self._api is not None and self._api_task is not None:
            self._api.should_exit = True
            await self._api_task
        self._remove_runtime_file()
        log.info("bridge stopped")

    async def serve_forever(self) -> None:
        """Run until SIGINT/SIGTERM, then stop gracefully."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await self.stop()

    async def __aenter__(self) -> "Bridge":
        await self.start()
        return self

    async def __aexit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # The runtime file tells the CLI, `simulate` and `demo` where this bridge listens.
    def _runtime_path(self) -> Path:
        return self.settings.data_dir / RUNTIME_FILE

    def _write_runtime_file(self) -> None:
        info = {"pid": os.getpid(), "ws_url": self.ws_url, "api_url": self.api_url}
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self._runtime_path().write_text(json.dumps(info) + "\n")

    def _remove_runtime_file(self) -> None:
        with contextlib.suppress(OSError):
            info = json.loads(self._runtime_path().read_text())
            if info.get("pid") == os.getpid():
                self._runtime_path().unlink()


def read_runtime_file(data_dir: Path) -> dict[str, Any] | None:
    """Where a bridge on this machine listens, or None when none has written its file."""
    try:
        info = json.loads((data_dir / RUNTIME_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted connections only when it does,
    # and without it every kept-alive API response waited ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock
