"""Shared fixtures: a real bridge on ephemeral loopback ports, devices that connect to it."""

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.auth import Tokens
from backend.server import Bridge
from simulator import SimulatedDevice
from testkit.llm_server import FakeLlm
from testkit.postgres import PostgresServer, running_postgres
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from testkit.stock_device import WireDevice
from tests.helpers import reap_started
from tests.scheduling import SpreadScheduling, spread_first


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> SpreadScheduling | None:
    """`--dist loadscope` means tests/scheduling.py's order (scripts/test uses it)."""
    if config.getoption("dist") == "loadscope":
        return SpreadScheduling(config, log)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("dist", "no") == "loadscope":
        spread_first(items)


@pytest.fixture(autouse=True)
async def no_leftover_processes() -> AsyncIterator[None]:
    yield
    await reap_started()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One throwaway PostgreSQL per test worker (testkit/postgres.py)."""
    with running_postgres() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    url = postgres_server.new_database()
    yield url
    postgres_server.drop_database(url)


@pytest.fixture
async def bridge_factory(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Start bridges with custom settings; all are stopped at teardown."""
    started: list[Bridge] = []

    async def start(*, clock: Callable[[], float] = time.monotonic, **overrides: Any) -> Bridge:
        settings = make_settings(tmp_path / f"data{len(started)}", **overrides)
        bridge = Bridge(settings, Tokens(admin=ADMIN_TOKEN, device=DEVICE_TOKEN), clock=clock)
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


@pytest.fixture
def fake_llm() -> Iterator[FakeLlm]:
    """The loopback fake LLM (OpenAI and Ollama wire formats); closed at teardown."""
    server = FakeLlm().start()
    yield server
    server.stop()


@pytest.fixture
async def simulated_devices() -> AsyncIterator[Callable[..., Any]]:
    """Start SimulatedDevices (the real firmware code) on a bridge, ready; stopped at teardown."""
    started: list[SimulatedDevice] = []

    async def start(bridge: Bridge, index: int = 1) -> SimulatedDevice:
        device = SimulatedDevice(bridge.ws_url, DEVICE_TOKEN, index=index)
        started.append(device)
        device.start()
        await bridge.registry.wait_for_state(device.device_id)
        return device

    yield start
    for device in started:
        await device.stop()
