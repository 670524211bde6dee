"""Helpers for the tests that run the firmware: on the MicroPython unix port as a process, and
against a `websockets` server on loopback that plays the bridge's part."""

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request

from backend.firmware import find_tool, firmware_dir, micropython_argv, micropython_env
from testkit.processes import WatchedProcess

MICROPYTHON = find_tool("micropython")
needs_micropython = pytest.mark.skipif(
    MICROPYTHON is None, reason="MicroPython unix port not installed"
)


async def run_micropython(script: Path, *args: str, timeout_s: float) -> tuple[int, str, str]:
    """Run `script` to its end with firmware/lib importable; (exit code, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        *micropython_argv(script, *args),
        env=micropython_env(firmware_dir() / "lib"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout_s)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


@contextlib.asynccontextmanager
async def running_firmware(
    config: Path, *, piped_stdin: bool = False
) -> AsyncIterator[WatchedProcess]:
    """firmware/main.py from the source tree, as `micropython main.py config.json`; stopped on
    exit, then its output is printed (pytest shows it when the test fails)."""
    firmware = firmware_dir()
    process = WatchedProcess(
        micropython_argv(firmware / "main.py", str(config)),
        micropython_env(firmware / "lib"),
        piped_stdin=piped_stdin,
    )
    await process.start()
    try:
        yield process
    finally:
        await process.stop()
        print("firmware output:\n" + process.output)


class LoopbackPeer(Protocol):
    """The far end of the firmware's WebSocket, played by a `websockets` server."""

    port: int

    async def handler(self, connection: ServerConnection) -> None: ...

    async def process_request(self, connection: ServerConnection, request: Request) -> Any: ...


PeerT = TypeVar("PeerT", bound=LoopbackPeer)


@contextlib.asynccontextmanager
async def serving(peer: PeerT) -> AsyncIterator[PeerT]:
    """Serve `peer` with `websockets` on a free loopback port, which becomes `peer.port`; no
    compression and no keepalive pings."""
    async with serve(
        peer.handler,
        "127.0.0.1",
        0,
        process_request=peer.process_request,
        compression=None,
        ping_interval=None,
    ) as server:
        peer.port = server.sockets[0].getsockname()[1]
        yield peer
