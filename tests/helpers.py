"""Helpers shared by the test modules (fixtures live in conftest.py; nothing is imported from
another test module)."""

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from backend.config import Settings
from backend.devices import Device, DeviceState
from backend.server import Bridge

ADMIN_TOKEN = "admin-secret-token-for-tests"
DEVICE_TOKEN = "device-secret-token-for-tests"
CLI = [sys.executable, "-m", "backend.cli"]
# Every long-running CLI process a test starts; conftest kills what a failed test left behind.
STARTED: list[asyncio.subprocess.Process] = []


def make_settings(data_dir: Path, **overrides: Any) -> Settings:
    """Bridge settings on ephemeral loopback ports with the tests' tokens and short timeouts."""
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "ws_host": "127.0.0.1",
        "ws_port": 0,
        "http_port": 0,
        "admin_token": ADMIN_TOKEN,
        "device_token": DEVICE_TOKEN,
        "hello_timeout_s": 5.0,
        "init_timeout_s": 5.0,
        "call_timeout_s": 5.0,
    }
    values.update(overrides)
    return Settings(**values)


async def wait_state(
    bridge: Bridge, device_id: str, state: DeviceState = DeviceState.READY, timeout_s: float = 5
) -> Device:
    return await bridge.registry.wait_for_state(device_id, state, timeout_s)


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `check` until it holds; fails the test with a clear message otherwise."""
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 - the condition has no event to wait on
            await asyncio.sleep(0.01)


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`esp32-bridge ARGS...` as a subprocess: (exit code, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        *CLI,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **(env or {})},
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
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
