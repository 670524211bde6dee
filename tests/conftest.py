"""Shared fixtures: a real bridge on ephemeral loopback ports, devices that connect to it."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.auth import Tokens
from backend.config import Settings
from backend.devices import DeviceState
from backend.server import Bridge
from bench.common import bench_settings
from tests.wire_device import WireDevice

ADMIN_TOKEN = "admin-secret-token-for-tests"
DEVICE_TOKEN = "device-secret-token-for-tests"


def make_settings(data_dir: Path, **overrides: Any) -> Settings:
    """Bridge settings on ephemeral loopback ports (bench_settings), with the tests' tokens."""
    values: dict[str, Any] = {
        "admin_token": ADMIN_TOKEN,
        "device_token": DEVICE_TOKEN,
        "hello_timeout_s": 5.0,
        "init_timeout_s": 5.0,
        "call_timeout_s": 5.0,
    }
    values.update(overrides)
    return bench_settings(data_dir, **values)


@pytest.fixture
async def bridge_factory(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Start bridges with custom settings; all are stopped at teardown."""
    started: list[Bridge] = []

    async def start(**overrides: Any) -> Bridge:
        settings = make_settings(tmp_path / f"data{len(started)}", **overrides)
        bridge = Bridge(settings, Tokens(admin=ADMIN_TOKEN, device=DEVICE_TOKEN))
        await bridge.start()
        started.append(bridge)
        return bridge

    yield start
    for bridge in started:
        await bridge.stop()


@pytest.fixture
async def bridge(tmp_path: Path) -> AsyncIterator[Bridge]:
    settings = make_settings(tmp_path / "data")
    async with Bridge(settings, Tokens(admin=ADMIN_TOKEN, device=DEVICE_TOKEN)) as running:
        yield running


@pytest.fixture
async def api(bridge: Bridge) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30) as client:
        yield client


@pytest.fixture
async def wire_devices(bridge: Bridge) -> AsyncIterator[Callable[..., Any]]:
    """Create WireDevices connected to `bridge`; closed at teardown."""
    devices: list[WireDevice] = []

    def create(device_id: str = "a4:cf:12:34:56:78", **kwargs: Any) -> WireDevice:
        device = WireDevice(bridge.ws_url, DEVICE_TOKEN, device_id, **kwargs)
        devices.append(device)
        return device

    yield create
    for device in devices:
        with contextlib.suppress(Exception):
            await device.close()


async def wait_state(
    bridge: Bridge, device_id: str, state: DeviceState = DeviceState.READY, timeout_s: float = 5
) -> Any:
    return await bridge.registry.wait_for_state(device_id, state, timeout_s)


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `check` until it holds; fails the test with a clear message otherwise."""
    async with asyncio.timeout(timeout_s):
        while not check():  # noqa: ASYNC110 - the condition has no event to wait on
            await asyncio.sleep(0.01)
