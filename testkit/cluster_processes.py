"""Bridge instances as real `esp32-bridge serve` processes (so one can be killed with SIGKILL),
configured for a cluster through the environment, as an operator would run them.

Used by tests/test_cluster_processes.py and bench/cluster.py."""

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit.processes import WatchedProcess

ADMIN_TOKEN = "cluster-admin-token-for-tests-0123456789"
DEVICE_TOKEN = "cluster-device-token-for-tests-0123456789"
START_TIMEOUT_S = 60.0


@dataclass
class ServeInstance:
    """One `serve` process: its data directory, environment, and what bridge.json says."""

    name: str
    data_dir: Path
    env: dict[str, str]
    process: WatchedProcess | None = None
    runtime: dict[str, Any] = field(default_factory=dict)
    # (ws, admin http, device http): fixed ports keep a balancer's server lines right across a
    # restart; 0 each (the default) lets the kernel choose.
    ports: tuple[int, int, int] = (0, 0, 0)

    @property
    def api_url(self) -> str:
        return str(self.runtime["api_url"])

    @property
    def ws_port(self) -> int:
        return int(str(self.runtime["ws_url"]).rsplit(":", 1)[1].split("/", 1)[0])

    @property
    def pid(self) -> int:
        assert self.process is not None and self.process.process is not None
        return self.process.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.running

    async def start(self) -> None:
        """Start and wait until its bridge.json names this process (it is listening)."""
        argv = [
            sys.executable, "-m", "backend", "serve", "--data-dir", str(self.data_dir),
            "--ws-port", str(self.ports[0]), "--http-port", str(self.ports[1]),
            "--device-http-port", str(self.ports[2]),
        ]  # fmt: skip
        self.process = WatchedProcess(argv, {**os.environ, **self.env})
        await self.process.start()
        pid = self.pid
        runtime_file = self.data_dir / "bridge.json"

        def listening() -> bool:
            with contextlib.suppress(OSError, ValueError):
                self.runtime = json.loads(runtime_file.read_text())
                return bool(self.runtime.get("pid") == pid)
            return False

        await self.process.wait_for(listening, f"{self.name} listening", START_TIMEOUT_S)

    async def kill(self) -> None:
        """SIGKILL: no shutdown code runs, sockets are closed by the kernel."""
        if self.process is not None:
            await self.process.kill()

    async def stop(self) -> None:
        """SIGTERM and wait (the graceful path)."""
        if self.process is not None and self.process.running:
            assert self.process.process is not None
            self.process.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.process.wait(), 20)
            except TimeoutError:
                await self.process.kill()
        if self.process is not None:
            await self.process.stop()


def serve_env(**settings: object) -> dict[str, str]:
    """The environment of a `serve` the tests drive: tokens they know, shared device auth, no
    LLM, voice or web search, quiet logs; `settings` on top (`database_url="..."`)."""
    env = {
        "BRIDGE_ADMIN_TOKEN": ADMIN_TOKEN,
        "BRIDGE_DEVICE_TOKEN": DEVICE_TOKEN,
        "BRIDGE_DEVICE_AUTH": "shared",
        "BRIDGE_LLM_PROVIDER": "none",
        "BRIDGE_SEARCH_ENABLED": "false",
        "BRIDGE_VOICE_ENABLED": "false",
        "BRIDGE_WS_HOST": "127.0.0.1",
        "BRIDGE_LOG_LEVEL": "warning",
    }
    env.update({f"BRIDGE_{key.upper()}": str(value) for key, value in settings.items()})
    return env


def instance_env(
    name: str, database_url: str, cluster_url: str, **settings: object
) -> dict[str, str]:
    """The environment of one cluster instance: `serve_env` with the shared database and
    broker and its own id, leases as given."""
    return serve_env(
        database_url=database_url, cluster_url=cluster_url, instance_id=name, **settings
    )


async def wait_until(check: Any, timeout_s: float, what: str) -> float:
    """Poll an async `check()` until truthy; the seconds it took (AssertionError on timeout)."""
    began = time.monotonic()
    while True:
        with contextlib.suppress(Exception):
            if await check():
                return time.monotonic() - began
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.05)
