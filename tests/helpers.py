"""Helpers shared by the test modules (fixtures live in conftest.py; nothing is imported from
another test module)."""

import asyncio
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from backend.devices import Device, DeviceState
from backend.server import Bridge

CLI = [sys.executable, "-m", "backend.cli"]
# Every long-running CLI process a test starts; conftest kills what a failed test left behind.
STARTED: list[asyncio.subprocess.Process] = []


class ManualClock:
    """A monotonic clock that moves only when the test says so (rate limits, log budgets)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def can_bind(address: str) -> bool:
    """Whether this machine has `address` (another loopback address plays another host; an
    IPv6 one, `::1`, may be missing)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


async def wait_state(
    bridge: Bridge, device_id: str, state: DeviceState = DeviceState.READY, timeout_s: float = 5
) -> Device:
    return await bridge.registry.wait_for_state(device_id, state, timeout_s)


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `check` until it holds; fails the test with a clear message otherwise."""
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 - the condition has no event to wait on
            await asyncio.sleep(0.01)


async def run_cli(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None
) -> tuple[int, str, str]:
    """`esp32-bridge ARGS...` as a subprocess: (exit code, stdout, stderr); `stdin` is typed in."""
    process = await asyncio.create_subprocess_exec(
        *CLI,
        *args,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})},
    )
    data = stdin.encode() if stdin is not None else None
    out, err = await asyncio.wait_for(process.communicate(data), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def start_cli(
    command: str, data_dir: Path, env: dict[str, str] | None = None, *extra: str
) -> asyncio.subprocess.Process:
    """`esp32-bridge COMMAND` (serve, demo) on ephemeral ports with its own tokens in `data_dir`
    (none from the environment); stdout and stderr are piped."""
    process = await asyncio.create_subprocess_exec(
        *CLI,
        command,
        "--data-dir",
        str(data_dir),
        "--ws-port",
        "0",
        "--http-port",
        "0",
        "--device-http-port",
        "0",
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "BRIDGE_ADMIN_TOKEN": "", "BRIDGE_DEVICE_TOKEN": "", **(env or {})},
    )
    STARTED.append(process)
    return process


async def reap_started() -> None:
    """Kill the CLI processes a test started and did not stop (a failed assertion, say)."""
    while STARTED:
        process = STARTED.pop()
        if process.returncode is None:
            process.kill()
            await process.wait()


async def create_key(bridge: Bridge, *scopes: str, devices: list[str] | None = None) -> str:
    """A new API key's token with these scopes (through the bridge's key store)."""
    created = await bridge.frontends.keys.create(
        f"test {' '.join(scopes)}", scopes, device_ids=devices
    )
    return created.token


async def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of a Server-Sent Events response, JSON-decoded (`[DONE]` kept as is)."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
