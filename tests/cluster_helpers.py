"""The fixtures and helpers the cluster test modules share; the cluster itself (instances, the
balancer, partitions) is testkit.cluster, which the benchmarks use too."""

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from simulator import SimulatedDevice
from testkit.cluster import Cluster, Partition, running_cluster
from testkit.postgres import PostgresServer
from testkit.settings import DEVICE_TOKEN

# ---- the fixtures and helpers the cluster test modules share (import them with `__all__`) ------


@pytest.fixture
async def cluster(tmp_path: Path, postgres_url: str) -> AsyncIterator[Cluster]:
    """A running cluster on the test's PostgreSQL database (instances started by the test)."""
    async with running_cluster(tmp_path, postgres_url) as running:
        yield running


@pytest.fixture
async def devices() -> AsyncIterator[list[SimulatedDevice]]:
    """Simulated devices the test starts (`start_device`), stopped after it."""
    started: list[SimulatedDevice] = []
    yield started
    for device in started:
        with contextlib.suppress(Exception):
            await device.stop()


@pytest.fixture
async def database_proxy(postgres_server: PostgresServer) -> AsyncIterator[Partition]:
    """A cuttable proxy in front of the test PostgreSQL's Unix socket."""
    proxy = Partition(unix_path=f"{postgres_server.socket_dir}/.s.PGSQL.5432")
    await proxy.start()
    yield proxy
    proxy.heal()
    await proxy.stop()


def start_device(
    started: list[SimulatedDevice], url: str, index: int, **kwargs: Any
) -> SimulatedDevice:
    """A simulated device that reconnects fast (0.2 s), added to `started` and started."""
    device = SimulatedDevice(url, DEVICE_TOKEN, index=index, reconnect_min_s=0.2, **kwargs)
    started.append(device)
    device.start()
    return device
