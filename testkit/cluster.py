"""Several bridge instances on one throwaway PostgreSQL and one real Mosquitto (each instance
with its own broker account), and a layer-4 balancer in front of their WebSocket ports: what
docs/cluster.md deploys, on loopback."""

import asyncio
import contextlib
import functools
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from backend.devices import UnknownDevice
from backend.server import Bridge
from backend.transports.mqtt_credentials import BridgeAccount
from testkit.mosquitto import Mosquitto
from testkit.ports import reserve_port
from testkit.settings import ADMIN_TOKEN, make_settings

NAMES = ("a", "b", "c")
FAST_LEASES = {"lease_ttl_s": 3.0, "lease_renew_s": 0.5}
# The default lease, and so a 3 s broker keepalive: for tests whose calls must all succeed while
# something else fails. On a loaded 2-core CI machine the fast lease's 2 s keepalive can drop the
# broker link (and fail calls across it) whatever the test is about.
DEFAULT_LEASES = {"lease_ttl_s": 6.0, "lease_renew_s": 2.0}
# Tests connect devices to one instance directly as often as through the balancer: rebalancing
# (which moves devices through the balancer) is on only where a test asks for it.
NO_REBALANCE = {"cluster_rebalance": False}


class Balancer:
    """A TCP balancer like HAProxy's `balance roundrobin` in mode tcp: each new connection goes
    to the next backend that accepts it; bytes are copied both ways untouched. `leastconn`: to
    the backend with the fewest open connections instead (HAProxy's `balance leastconn`, what
    deploy/haproxy.cfg uses)."""

    def __init__(self, leastconn: bool = False) -> None:
        self.leastconn = leastconn
        self.open: dict[tuple[str, int], int] = {}  # connections open now, by backend
        self.backends: list[tuple[str, int]] = []
        self.port = reserve_port(self)
        self._server: asyncio.Server | None = None
        self._turn = itertools.count()
        self._pipes: set[asyncio.Task[None]] = set()
        self.connections: dict[tuple[str, int], int] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/xiaozhi/v1/"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        turn = next(self._turn)
        order = [self.backends[(turn + i) % len(self.backends)] for i in range(len(self.backends))]
        if self.leastconn:
            order.sort(key=lambda backend: self.open.get(backend, 0))  # stable: ties rotate
        for backend in order:
            try:
                up_reader, up_writer = await asyncio.open_connection(*backend)
            except OSError:
                continue
            self.connections[backend] = self.connections.get(backend, 0) + 1
            self.open[backend] = self.open.get(backend, 0) + 1
            pipes = [
                asyncio.create_task(_pipe(source, sink))
                for source, sink in ((reader, up_writer), (up_reader, writer))
            ]
            for task in pipes:
                self._pipes.add(task)
                task.add_done_callback(self._pipes.discard)
            closed = asyncio.gather(*pipes, return_exceptions=True)
            closed.add_done_callback(functools.partial(self._closed_after, backend))
            return
        writer.close()

    def _closed_after(self, backend: tuple[str, int], _done: object) -> None:
        self.open[backend] = self.open.get(backend, 1) - 1


async def _pipe(
    source: asyncio.StreamReader,
    sink: asyncio.StreamWriter,
    flowing: asyncio.Event | None = None,
) -> None:
    """Copy bytes one way until either side closes; while `flowing` is clear, hold them (a
    black hole: nothing is sent, nothing is refused)."""
    try:
        while data := await source.read(65536):
            if flowing is not None:
                await flowing.wait()
            sink.write(data)
            await sink.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            sink.close()


@dataclass
class Cluster:
    """Instances by name, started on demand, all stopped at the end."""

    workdir: Path
    database_url: str
    broker: Mosquitto
    accounts: dict[str, BridgeAccount]
    balancer: Balancer
    bridges: dict[str, Bridge] = field(default_factory=dict)

    async def start(self, name: str, **overrides: Any) -> Bridge:
        values: dict[str, Any] = {
            "database_url": self.database_url,
            "cluster_url": self.broker.url_of(self.accounts[name]),
            "instance_id": name,
            **FAST_LEASES,
            **NO_REBALANCE,
            **overrides,
        }
        settings = make_settings(self.workdir / name, **values)
        bridge = Bridge(settings)
        await bridge.start()
        assert bridge.cluster is not None
        await bridge.cluster.fabric.wait_connected(10)
        node = bridge.cluster
        await until(lambda: node.health() is None, what=f"{name} ready (fleet view whole)")
        self.bridges[name] = bridge
        self.balancer.backends.append(("127.0.0.1", bridge.websocket.port))
        return bridge

    async def stop(self, name: str) -> None:
        bridge = self.bridges.pop(name)
        with contextlib.suppress(ValueError):  # a test may have taken it out of the balancer
            self.balancer.backends.remove(("127.0.0.1", bridge.websocket.port))
        await bridge.stop()

    def api(self, name: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.bridges[name].api_url,
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=30,
        )


@contextlib.asynccontextmanager
async def running_cluster(
    workdir: Path, database_url: str, device_logins: dict[str, str] | None = None
) -> AsyncIterator[Cluster]:
    """`device_logins`: broker accounts of devices (key -> password), for hostile tests."""
    accounts = {name: BridgeAccount(f"bridge-{name}") for name in NAMES}
    broker = Mosquitto(
        workdir / "broker", device_logins or {}, more_bridges=tuple(accounts.values())
    )
    await broker.start()
    balancer = Balancer()
    await balancer.start()
    cluster = Cluster(workdir, database_url, broker, accounts, balancer)
    try:
        yield cluster
    finally:
        for name in list(cluster.bridges):
            with contextlib.suppress(Exception):
                await cluster.stop(name)
        await balancer.stop()
        await broker.stop()


def fleet_state(bridge: Bridge, device_id: str) -> str | None:
    """The device's state in this instance's fleet view; None while the instance has not heard
    of it (another instance's report travels through the broker: not there at once)."""
    try:
        return str(bridge.registry.summary(device_id)["state"])
    except UnknownDevice:
        return None


async def until(check: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> Any:
    """Poll until `check()` is truthy; return it. Fails with `what` after `timeout_s`."""
    try:
        async with asyncio.timeout(timeout_s):
            while not (value := check()):  # noqa: ASYNC110 - state spread over instances
                await asyncio.sleep(0.02)
            return value
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what or check}") from None


class Partition:
    """A TCP proxy between one instance and a service (PostgreSQL on its Unix socket, or the
    broker), which a test cuts: `refuse` closes every connection and refuses new ones (a stopped
    service); `blackhole` keeps the connections but forwards nothing (traffic dropped)."""

    def __init__(self, unix_path: str | None = None, port: int | None = None) -> None:
        self.unix_path = unix_path
        self.target_port = port
        self.port = reserve_port(self)
        self.mode: str | None = None
        self._server: asyncio.Server | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._pipes: set[asyncio.Task[None]] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", self.port, reuse_address=True
        )

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._flowing.set()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    def cut(self, mode: str) -> None:
        self.mode = mode
        if mode == "blackhole":
            self._flowing.clear()
            return
        for client, upstream in list(self._links):
            for writer in (client, upstream):
                with contextlib.suppress(Exception):
                    writer.transport.abort()
        self._links.clear()

    def heal(self) -> None:
        self.mode = None
        self._flowing.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode == "refuse":
            writer.transport.abort()
            return
        try:
            if self.unix_path is not None:
                up_reader, up_writer = await asyncio.open_unix_connection(self.unix_path)
            else:
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        link = (writer, up_writer)
        self._links.add(link)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(_pipe(source, sink, self._flowing))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)
