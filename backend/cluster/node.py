"""One bridge instance in a cluster: leases for its devices, the fleet view, forwarded calls.

- **Ownership.** Every local device event goes through one ordered outbox: a connect claims the
  device's lease (a batch of connects is one transaction) before its event is published, a
  disconnect releases it. Leases are renewed every `lease_renew_s`; a device whose lease another
  instance took (it reconnected there) has its stale link here closed. If renewals fail for
  longer than the lease lasts, the instance is *fenced*: it closes its device links and takes no
  new ones until the database answers again, so no device is ever served by two instances.
- **Fleet view.** Events of local devices are published to every instance; the reports of other
  instances' devices go into the registry (`RemoteDevice`), so listings, server-sent events and
  calls see the whole fleet. An instance that leaves, dies (its will) or stops heartbeating has
  its devices taken offline everywhere, and calls in flight to it fail at once.
- **Forwarded calls.** A call to a remote device goes to its owner as an MQTT 5 request (response
  topic + correlation data, expiry = the deadline); a cancelled caller sends `cancel`.
- **MQTT shards.** With `mqtt_shards` > 1 the instance keeps a fair share of the shard leases and
  its MQTT transport subscribes to exactly those.
"""

import asyncio
import contextlib
import math
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import structlog

from backend.cluster import wire
from backend.cluster.balance import (
    DrainProgress,
    Rebalancer,
    Shedder,
    serving_instances,
    shard_target,
)
from backend.cluster.fabric import Fabric, FabricUnavailable, Inbound, Topics
from backend.cluster.leases import InstanceRow, LeaseTable
from backend.config import Settings
from backend.devices.device import Device, RemoteDevice
from backend.devices.errors import DeviceLayerError, DeviceOffline, UnknownDevice
from backend.devices.registry import DeviceRegistry
from backend.devices.state import DeviceEvent, EventKind, ToolSet
from backend.mcp_session import CallResult, DeviceDisconnected, McpError, RequestTimeout
from backend.mcp_session.models import TimeoutPolicy
from backend.storage import Database, DatabaseError

log = structlog.get_logger("cluster")

SERVICE_RESTART = 1012  # WebSocket close code: "reconnect, the service is restarting"
FORWARD_MARGIN_S = 2.0  # the hop to the owner and back, on top of the device's own deadline
_FENCE_MARGIN_S = 1.0  # stop serving this long before the last renewed leases expire
# While forwarded calls wait, the broker is probed this often, each probe acknowledged within
# this long: a broker that stops answering fails them in about a second, not at their deadline.
BROKER_PROBE_EVERY_S = 0.4
BROKER_PROBE_TIMEOUT_S = 0.6
MAX_REMOTE_DIALINS = 1000  # per instance: a peer's list is trusted, but bounded
SERVING_GRACE_S = 5.0  # a stopping instance waits this long for the calls it is serving
SYNC_WAIT_S = 5.0  # a (re)joined instance is ready once its peers answered, or after this


class ShardedTransport(Protocol):
    """The MQTT transport's side of shard ownership."""

    async def set_shards(self, shards: Iterable[int] | None) -> None:
        """Serve exactly these shards (None: all)."""


@dataclass(frozen=True, slots=True)
class ClusterOptions:
    """The cluster settings of one instance."""

    url: str
    instance_id: str
    prefix: str
    ttl_s: float
    renew_s: float
    shards: int
    timeouts: TimeoutPolicy
    drain_notice_s: float = 4.0  # docs/cluster.md, "Drain and rolling upgrade"
    drain_rate_per_s: float = 50.0
    rebalance: bool = True  # docs/cluster.md, "Rebalancing"
    rebalance_rate_per_s: float = 10.0

    @classmethod
    def of(cls, settings: Settings) -> "ClusterOptions":
        """From the bridge's settings (`cluster_url` must be set)."""
        assert settings.cluster_url is not None
        return cls(
            url=settings.cluster_url,
            instance_id=settings.instance_id or _host_name(),
            prefix=settings.mqtt_topic_prefix,
            ttl_s=settings.lease_ttl_s,
            renew_s=settings.lease_renew_s,
            shards=settings.mqtt_shards,
            timeouts=TimeoutPolicy(
                default_s=settings.call_timeout_s, per_tool=dict(settings.tool_timeouts)
            ),
            drain_notice_s=settings.drain_notice_s,
            drain_rate_per_s=settings.drain_rate_per_s,
            rebalance=settings.cluster_rebalance,
            rebalance_rate_per_s=settings.rebalance_rate_per_s,
        )


def _host_name() -> str:
    name = "".join(c if c.isalnum() or c in "_.-" else "-" for c in socket.gethostname())
    return name[:64] or "bridge"


class ClusterNode:
    """This instance's membership: start after the database, stop before it closes."""

    def __init__(
        self,
        options: ClusterOptions,
        registry: DeviceRegistry,
        database: Database,
        *,
        api_url: Callable[[], str | None] = lambda: None,
        mqtt: ShardedTransport | None = None,
        dialins: Callable[[], list[dict[str, Any]]] = list,
    ) -> None:
        """`dialins`: the summaries of the MCP servers dialed in to this instance (shown by
        every instance; call `dialins_changed` when they change)."""
        self.options = options
        self.instance_id = options.instance_id
        self.registry = registry
        self.leases = LeaseTable(database, options.instance_id, options.ttl_s)
        self.topics = Topics(options.prefix, options.instance_id)
        self.fabric = Fabric(
            options.url,
            self.topics,
            on_message=self._on_message,
            on_connect=self._on_fabric_connect,
            on_disconnect=self._on_fabric_lost,
            keepalive_s=max(2, int(options.ttl_s / 2)),
        )
        self._api_url = api_url
        self._mqtt = mqtt if options.shards > 1 else None
        self._dialins = dialins
        self._remote_dialins: dict[str, list[dict[str, Any]]] = {}  # instance -> summaries
        self._dialins_dirty = asyncio.Event()
        self._outbox: asyncio.Queue[tuple[DeviceEvent, dict[str, Any] | None]] = asyncio.Queue()
        self._epochs: dict[str, int] = {}  # local device -> the epoch of its lease
        self._awaited_tools: dict[str, str] = {}  # remote device -> digest to read
        self._pending: dict[bytes, tuple[asyncio.Future[dict[str, Any]], str]] = {}
        self._serving: dict[bytes, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._unsubscribe: Callable[[], None] | None = None
        self._renewed_at = time.monotonic()  # the start of the last successful renewal
        # Riding out a database outage (docs/cluster.md, "Failure model"): while the broker is
        # connected this instance hears of every claim of its devices elsewhere, so it keeps them.
        self._present: set[str] = set()  # instances whose broker presence is up
        self._fabric_lost_at = time.monotonic()  # when the broker was last seen, while it is away
        self._db_lost_at: float | None = None  # the first failed renewal of an outage
        self._broker_watch: asyncio.Task[None] | None = None
        self._fabric_connected_at = time.monotonic()
        self._synced_from: set[str] = set()  # peers that answered our last sync whole
        self._sync_peers: set[str] = set()  # the peers up when we (re)connected
        self.fenced = False
        self.draining = False
        self._stopping = False
        self.shards: frozenset[int] = frozenset()
        self.instances: list[InstanceRow] = []
        # Moving devices off this instance (backend/cluster/balance.py): drain and rebalance.
        idle_wait_s = max(options.timeouts.default_s, *options.timeouts.per_tool.values())
        self.shedder = Shedder(registry, idle_wait_s=idle_wait_s + FORWARD_MARGIN_S)
        self.rebalancer = Rebalancer(
            self.shedder,
            options.instance_id,
            enabled=options.rebalance,
            rate_per_s=options.rebalance_rate_per_s,
            renew_s=options.renew_s,
            ttl_s=options.ttl_s,
            spawn=self._spawn,
        )
        self.drain_progress: DrainProgress | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._shards_released = False  # a drain keeps its shards until the balancer noticed
        self.counters = {"forwarded": 0, "served": 0, "stale_links_closed": 0, "fenced": 0}

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Join (database row), follow the registry, connect to the broker, start renewing."""
        self.registry.instance_id = self.instance_id
        await self.leases.join(self._api_url(), time.time())
        if self._mqtt is not None:
            await self._mqtt.set_shards(frozenset())  # none until a renewal grants some
        self._unsubscribe = self.registry.subscribe(self._on_local_event)
        self._renewed_at = time.monotonic()
        await self._renew()
        self._tasks = [
            asyncio.create_task(self._run_outbox(), name="cluster-outbox"),
            asyncio.create_task(self._run_renewals(), name="cluster-renewals"),
            asyncio.create_task(self._run_dialin_updates(), name="cluster-dialins"),
        ]
        self.fabric.start()
        log.info("cluster instance joined", instance=self.instance_id)

    async def stop(self) -> None:
        """Leave: give up leases, clear presence, fail forwarded calls still waiting."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # A cancel that lands as a database deadline expires can come out as TimeoutError
            # (Python 3.11's asyncio.timeout): the loops also stop on `_stopping`.
            await asyncio.wait(self._tasks, timeout=self._db_deadline_s + 1)
        self._tasks = []
        if self._serving:  # calls forwarded to us finish (a rolling restart fails none)
            await asyncio.wait(list(self._serving.values()), timeout=SERVING_GRACE_S)
        for task in list(self._serving.values()):
            task.cancel()
        if self._broker_watch is not None:
            self._broker_watch.cancel()
        self._fail_pending(None, "bridge instance stopping")
        await self.fabric.stop()
        with contextlib.suppress(DatabaseError, TimeoutError):
            async with asyncio.timeout(self._db_deadline_s):
                await self.leases.leave()

    def start_drain(self) -> DrainProgress:
        """Start draining (once: a second call joins the first) and return its progress."""
        if self._drain_task is None:
            self.draining = True  # readiness answers 503 from now on; new devices are refused
            self.drain_progress = DrainProgress(
                started_at=time.time(), devices_left=len(self.registry)
            )
            self._drain_task = asyncio.create_task(self._drain(), name="cluster-drain")
            self._tasks.append(self._drain_task)
        assert self.drain_progress is not None
        return self.drain_progress

    async def drain(self) -> int:
        """Drain hitlessly (docs/cluster.md, "Drain and rolling upgrade") and return once every
        device was told to reconnect: how many were."""
        progress = self.start_drain()
        assert self._drain_task is not None
        await asyncio.shield(self._drain_task)
        return progress.devices_told

    async def _drain(self) -> None:
        """Readiness is 503 already. Keep serving while the balancer notices (a device told to
        reconnect before that could land here again and be refused), then give up the MQTT
        shards and move the devices at `drain_rate_per_s`, each once its calls finished."""
        progress = self.drain_progress
        assert progress is not None
        with contextlib.suppress(DatabaseError, TimeoutError):
            async with asyncio.timeout(self._db_deadline_s):
                await self.leases.set_draining(True)
        log.info(
            "cluster instance draining",
            instance=self.instance_id,
            devices=len(self.registry),
            notice_s=self.options.drain_notice_s,
        )
        if len(self.registry) or self.shards:  # nothing to keep: nothing to wait for
            await asyncio.sleep(self.options.drain_notice_s)
        self._shards_released = True
        if self._mqtt is not None and self.shards:
            self.shards = frozenset()
            await self._mqtt.set_shards(self.shards)
        progress.phase = "moving"
        device_ids = [device.device_id for device in self.registry]
        progress.devices_left = len(device_ids)

        def told(count: int) -> None:
            progress.devices_told = count
            progress.devices_left = len(self.registry)

        await self.shedder.shed(
            device_ids,
            self.options.drain_rate_per_s,
            "bridge instance draining: reconnect",
            told=told,
        )
        await self._renew()  # the shard leases go back now, not at the next renewal
        progress.phase = "done"
        progress.devices_left = len(self.registry)
        progress.finished_at = time.time()
        log.info(
            "cluster instance drained",
            instance=self.instance_id,
            devices=progress.devices_told,
            seconds=round(progress.finished_at - progress.started_at, 1),
        )

    # ---- local events: claim, publish, release -------------------------------------------------

    def _on_local_event(self, event: DeviceEvent) -> None:
        if event.origin is not None or event.kind not in wire.FLEET_KINDS:
            return
        refusal = self._refusal()
        if event.kind is EventKind.CONNECTED and refusal is not None:
            # Draining or fenced: the device must go elsewhere now, not after a claim that
            # would wait for an unreachable database. (After the connect returns: not inside it.)
            asyncio.get_running_loop().call_soon(
                self.registry.disconnect, event.device_id, refusal, SERVICE_RESTART
            )
            return
        device = self.registry.get(event.device_id)
        snapshot = None
        if device is not None and event.kind is not EventKind.DISCONNECTED:
            snapshot = wire.device_report(event.kind, device, self.instance_id, 0)
        self._outbox.put_nowait((event, snapshot))

    async def _run_outbox(self) -> None:
        while True:
            batch = [await self._outbox.get()]
            while not self._outbox.empty() and len(batch) < 1000:
                batch.append(self._outbox.get_nowait())
            await self._claim_connects(batch)
            reports = [
                report for event, snapshot in batch if (report := self._report(event, snapshot))
            ]
            # A burst (a reconnect storm) goes out as a few messages, not one per event: each
            # publish is a QoS 1 round trip and a socket write on both sides.
            await self._publish_reports(self.topics.events, reports)

    async def _claim_connects(self, batch: list[tuple[DeviceEvent, dict[str, Any] | None]]) -> None:
        connects: dict[str, str] = {}
        for event, snapshot in batch:
            if event.kind is EventKind.CONNECTED and snapshot is not None:
                connects[event.device_id] = str(snapshot["transport"])
        if not connects:
            return
        refusal = self._refusal() or await self._unannounceable()
        if refusal is None:
            try:
                async with asyncio.timeout(self._db_deadline_s):
                    claimed = await self.leases.claim(connects.items(), time.time())
                self._epochs.update(claimed)
                return
            except (DatabaseError, TimeoutError) as exc:
                refusal = f"bridge instance cannot claim devices ({exc or 'no answer'}): reconnect"
        for device_id in connects:
            self.registry.disconnect(device_id, refusal, SERVICE_RESTART)

    async def _unannounceable(self) -> str | None:
        """Why a claim made now could not be heard by the others, or None. A claim is made only
        while the broker carries it: an instance riding out a database outage keeps its devices
        because it would hear of a claim of one of them."""
        if self._db_lost_at is not None:
            return "bridge instance cannot reach its database: reconnect"
        if not self.fabric.connected:
            try:
                await self.fabric.wait_connected(self._db_deadline_s)
            except TimeoutError:
                return "bridge instance cannot reach the cluster broker: reconnect"
        return None

    def _refusal(self) -> str | None:
        if self.draining:
            return "bridge instance draining: reconnect"
        if self.fenced:
            return "bridge instance lost its database: reconnect"
        return None

    def _report(self, event: DeviceEvent, snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
        """The fleet event of one local event (None: nothing to say), releasing the lease of a
        device that left."""
        device_id = event.device_id
        if event.kind is EventKind.DISCONNECTED:
            epoch = self._epochs.pop(device_id, 0)
            if epoch and not self.fenced and self.registry.get(device_id) is None:
                self._spawn(self._release(device_id, epoch))  # never holds up the outbox
            return {
                "v": wire.VERSION,
                "kind": EventKind.DISCONNECTED.value,
                "device_id": device_id,
                "owner": self.instance_id,
                "epoch": epoch,
                "state": "offline",
                "reason": str(event.detail.get("reason", "")),
            }
        if snapshot is None or device_id not in self._epochs:
            return None  # refused above, or gone already
        return {**snapshot, "epoch": self._epochs[device_id]}

    async def _publish_reports(self, topic: str, reports: list[dict[str, Any]]) -> None:
        with contextlib.suppress(FabricUnavailable):
            for message in wire.pack(reports):
                await self.fabric.publish(topic, message)

    async def _release(self, device_id: str, epoch: int) -> None:
        with contextlib.suppress(DatabaseError, TimeoutError):
            async with asyncio.timeout(self._db_deadline_s):
                await self.leases.release(device_id, epoch)

    # ---- renewals -------------------------------------------------------------------------------

    async def _run_renewals(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.options.renew_s)
            await self._renew()

    async def _renew(self) -> None:
        began = time.monotonic()
        claimed_before = dict(self._epochs)  # a claim made while the renewal runs is not stale
        try:
            # A database that stops answering (traffic dropped, not refused) must not hold the
            # renewal past the point where the leases expire.
            async with asyncio.timeout(self._db_deadline_s):
                renewal = await self.leases.renew(
                    time.time(),
                    self.options.shards,
                    self._shard_target(),
                    held=self._held() if self._db_lost_at is not None else None,
                    present=frozenset(self._present),
                )
        except (DatabaseError, TimeoutError) as exc:
            self._renewal_failed(str(exc) or "no answer in time")
            return
        self._renewed_at = began
        if self._db_lost_at is not None:
            log.info(
                "database reachable again",
                instance=self.instance_id,
                outage_s=round(began - self._db_lost_at, 1),
                fenced=self.fenced,
            )
            self._db_lost_at = None
        if self.fenced:
            self.fenced = False
            log.info("database reachable again: taking devices", instance=self.instance_id)
        self.instances = renewal.instances
        self._close_stale(renewal.devices, claimed_before)
        self._forget_silent_instances(renewal.instances)
        if self._mqtt is not None and renewal.shards != self.shards:
            self.shards = renewal.shards
            await self._mqtt.set_shards(self.shards)
            log.info("mqtt shards", instance=self.instance_id, shards=sorted(self.shards))
        self.rebalancer.renewed(
            self.instances, serving=self._refusal() is None and self.fabric.connected
        )

    def _renewal_failed(self, error: str) -> None:
        """Fence only when this instance cannot tell whether it still owns its devices: the
        database is away AND the broker (which carries every claim made elsewhere) has been away
        for as long as a lease lasts."""
        now = time.monotonic()
        if self._db_lost_at is None:
            self._db_lost_at = now
            log.warning(
                "lease renewal failed",
                error=error,
                riding_through=self.fabric.connected,
                devices=len(self._epochs),
            )
        heard_at = now if self.fabric.connected else self._fabric_lost_at
        if now - max(self._renewed_at, heard_at) > self.options.ttl_s - _FENCE_MARGIN_S:
            self._fence()

    def _held(self) -> dict[str, tuple[int, str]]:
        """The devices this instance serves, with their epochs and transports (to write their
        leases back after an outage)."""
        held: dict[str, tuple[int, str]] = {}
        for device_id, epoch in self._epochs.items():
            device = self.registry.get(device_id)
            if device is not None:
                held[device_id] = (epoch, device.transport)
        return held

    @property
    def riding_through(self) -> bool:
        """Whether the database is away while this instance keeps serving its devices."""
        return self._db_lost_at is not None and not self.fenced

    @property
    def _db_deadline_s(self) -> float:
        return max(0.5, self.options.ttl_s / 3)

    def _shard_target(self) -> int | None:
        if self._mqtt is None:
            return None
        if self.fenced or (self.draining and self._shards_released):
            return 0
        if self.draining:  # until the balancer noticed: keep what it has, take no more
            return len(self.shards)
        serving = serving_instances(
            self.instances, self.instance_id, time.time(), self.options.ttl_s
        )
        return shard_target(self.options.shards, serving, self.instance_id)

    def _close_stale(self, owned: dict[str, int], claimed_before: dict[str, int]) -> None:
        """Close the links of devices whose lease the renewal found taken by another instance;
        only of claims older than the renewal (one made meanwhile is not in what it read)."""
        for device_id, epoch in list(self._epochs.items()):
            if owned.get(device_id) == epoch or self.registry.get(device_id) is None:
                continue
            if claimed_before.get(device_id) != epoch:
                continue
            self.counters["stale_links_closed"] += 1
            self._epochs.pop(device_id, None)
            self.registry.disconnect(
                device_id, "the device's lease moved to another bridge instance", 1000
            )

    def _fence(self) -> None:
        if self.fenced:
            return
        self.fenced = True
        self.counters["fenced"] += 1
        log.error(
            "device leases expired without renewal: closing every device link",
            instance=self.instance_id,
            devices=len(self.registry),
        )
        for device in list(self.registry):
            self.registry.disconnect(
                device.device_id, "bridge instance lost its database: reconnect", SERVICE_RESTART
            )
        self._epochs.clear()
        if self._mqtt is not None:
            self.shards = frozenset()
            self._spawn(self._mqtt.set_shards(self.shards))

    def _forget_silent_instances(self, instances: list[InstanceRow]) -> None:
        now = time.time()
        silent = {
            row.instance_id
            for row in instances
            if now - row.heartbeat_at > self.options.ttl_s
            and row.instance_id != self.instance_id
            and row.instance_id not in self._present  # cut off from the database, not gone
        }
        owners = {device.owner for device in self.registry.remote_devices()}
        for owner in owners & silent:
            self._owner_gone(owner, f"bridge instance {owner} stopped renewing its leases")

    # ---- the fabric ------------------------------------------------------------------------------

    async def _on_fabric_connect(self) -> None:
        """After each (re)connect: ask for everyone's devices, and tell ours again (while the
        broker was away our will took our devices offline on the other instances)."""
        self._fabric_connected_at = time.monotonic()
        self._synced_from = set()
        now = time.time()  # the peers up now (from the database): each answers this sync
        self._sync_peers = set(
            serving_instances(
                self.instances, self.instance_id, now, self.options.ttl_s, me_serving=False
            )
        )
        await self.fabric.publish(self.topics.sync, wire.dumps({"from": self.instance_id}))
        self.dialins_changed()
        await self._publish_snapshot(self.topics.events)

    def _on_fabric_lost(self) -> None:
        """Calls waiting for another instance fail now; its devices are of unknown state until
        the broker is back (the sync after the reconnect reports them again)."""
        self._fabric_lost_at = time.monotonic()
        self._present.clear()
        self._fail_pending(None, "cluster broker connection lost")
        for owner in {device.owner for device in self.registry.remote_devices()}:
            self.registry.remote_owner_gone(owner, "cluster broker connection lost: state unknown")

    def _on_message(self, message: Inbound) -> None:
        if message.channel == "dialins":
            self._on_dialins(message)
            return
        if message.channel == "presence":
            if message.instance and message.instance != self.instance_id:
                if message.payload:
                    self._present.add(message.instance)
                else:
                    self._present.discard(message.instance)
                    self._owner_gone(message.instance, f"bridge instance {message.instance} left")
            return
        try:
            body = wire.loads(message.payload)
        except wire.WireError as exc:
            log.warning("cluster message dropped", channel=message.channel, error=str(exc))
            return
        if message.channel == "events" or (message.channel == "reply" and "reports" in body):
            self._on_reports(body)
        elif message.channel == "sync":
            requester = body.get("from")
            if isinstance(requester, str) and requester != self.instance_id:
                self._spawn(self._answer_sync(requester))
        elif message.channel == "rpc":
            self._on_request(body, message)
        elif message.channel == "reply" and isinstance(body.get("synced"), str):
            self._synced_from.add(body["synced"])
        elif message.channel == "reply":
            self._on_reply(body, message)

    # ---- dialed-in MCP servers, fleet-wide ------------------------------------------------------

    def dialins_changed(self) -> None:
        """The MCP servers dialed in here changed: publish the list (coalesced)."""
        self._dialins_dirty.set()

    async def _run_dialin_updates(self) -> None:
        while not self._stopping:
            await self._dialins_dirty.wait()
            self._dialins_dirty.clear()
            servers = [{**summary, "instance": self.instance_id} for summary in self._dialins()]
            with contextlib.suppress(FabricUnavailable):  # published again at the next connect
                await self.fabric.publish(
                    self.topics.dialins(), wire.dumps({"servers": servers}), retain=True
                )

    def _on_dialins(self, message: Inbound) -> None:
        owner = message.instance
        if not owner or owner == self.instance_id:
            return
        if not message.payload:
            self._remote_dialins.pop(owner, None)
            return
        try:
            servers = wire.loads(message.payload).get("servers")
        except wire.WireError as exc:
            log.warning("cluster message dropped", channel="dialins", error=str(exc))
            return
        if isinstance(servers, list):
            self._remote_dialins[owner] = [
                {**server, "instance": owner} for server in servers if isinstance(server, dict)
            ][:MAX_REMOTE_DIALINS]

    def remote_dialins(self) -> list[dict[str, Any]]:
        """The MCP servers dialed in to the other instances that are up (broker presence)."""
        return [
            server
            for owner, servers in sorted(self._remote_dialins.items())
            if owner in self._present
            for server in servers
        ]

    def _on_reports(self, body: dict[str, Any]) -> None:
        """One report, or a snapshot: `{"reports": [...]}` (a join, or a return after the broker
        was away)."""
        reports = body.get("reports")
        if reports is None:
            self._on_report(body)
        elif isinstance(reports, list):
            for report in reports:
                if isinstance(report, dict):
                    self._on_report(report)

    def _on_report(self, body: dict[str, Any]) -> None:
        try:
            report = wire.parse_report(body)
        except wire.WireError as exc:
            log.warning("fleet event dropped", error=str(exc))
            return
        if report.owner == self.instance_id:
            return
        mine = self._epochs.get(report.device_id)
        if (
            report.kind is not EventKind.DISCONNECTED
            and self.registry.get(report.device_id) is not None
            and mine is not None
            and report.epoch > mine
        ):
            # It reconnected to another instance: the link here is stale.
            self.counters["stale_links_closed"] += 1
            self._epochs.pop(report.device_id, None)
            self.registry.disconnect(
                report.device_id, f"reconnected to bridge instance {report.owner}", 1000
            )
        self._awaited_tools.pop(report.device_id, None)
        if report.tools is None and report.tools_digest is not None:
            tools = ToolSet.known(report.tools_digest)
            if tools is None:  # a long list: read it from the catalogue once it is stored
                self._awaited_tools[report.device_id] = report.tools_digest
                self._spawn(self._read_stored_tools(report.device_id, report.epoch))
            report = replace(report, tools=tools)
        self.registry.remote_reported(report, self._forward)

    async def _read_stored_tools(self, device_id: str, epoch: int) -> None:
        """The owner's catalogue stores a new tool list within its flush interval: retry."""
        for delay in (0.2, 0.4, 0.8, 1.6, 3.2):
            await asyncio.sleep(delay)
            digest = self._awaited_tools.get(device_id)
            if digest is None:
                return  # a later report replaced that one
            with contextlib.suppress(DatabaseError, TimeoutError):
                async with asyncio.timeout(self._db_deadline_s):
                    tools = await self.leases.tool_list(digest)
                if tools is not None and self._awaited_tools.get(device_id) == digest:
                    del self._awaited_tools[device_id]
                    self.registry.remote_tools_read(device_id, epoch, tools)
                    return
        log.warning("a remote device's tool list is not in the catalogue", device_id=device_id)

    async def _answer_sync(self, requester: str) -> None:
        """Our devices to an instance that (re)joined, then "that was all" (it is ready once
        every peer's answer is in: its fleet view is whole)."""
        topic = self.topics.reply(requester)
        await self._publish_snapshot(topic)
        with contextlib.suppress(FabricUnavailable):
            await self.fabric.publish(topic, wire.dumps({"synced": self.instance_id}))

    def _fleet_view_whole(self) -> bool:
        """Whether every peer that was up when we (re)connected answered our sync (or
        `SYNC_WAIT_S` passed: an instance of an older version does not say "that was all")."""
        if not self.fabric.connected:
            return True  # not a readiness matter (docs/cluster.md, "Failure model")
        if time.monotonic() - self._fabric_connected_at > SYNC_WAIT_S:
            return True
        return self._sync_peers <= self._synced_from

    async def _publish_snapshot(self, topic: str) -> None:
        reports = [
            wire.device_report(EventKind.CONNECTED, device, self.instance_id, epoch)
            for device in list(self.registry)
            if (epoch := self._epochs.get(device.device_id))
        ]
        await self._publish_reports(topic, reports)

    def _owner_gone(self, owner: str, reason: str) -> None:
        dropped = self.registry.remote_owner_gone(owner, reason)
        failed = self._fail_pending(owner, reason)
        if dropped or failed:
            log.info("instance gone", instance=owner, devices=dropped, calls_failed=failed)

    def _fail_pending(self, owner: str | None, reason: str) -> int:
        failed = 0
        for future, target in list(self._pending.values()):
            if (owner is None or target == owner) and not future.done():
                future.set_exception(DeviceDisconnected(reason))
                failed += 1
        return failed

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    # ---- forwarded calls: the caller's side -----------------------------------------------------

    async def _forward(
        self,
        device: RemoteDevice,
        tool: str,
        arguments: dict[str, Any],
        timeout_s: float | None,
        actor: str | None,
    ) -> CallResult:
        budget = timeout_s if timeout_s is not None else self.options.timeouts.for_tool(tool)
        wait_s = budget + FORWARD_MARGIN_S
        correlation = uuid.uuid4().bytes
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[correlation] = (future, device.owner)
        request = wire.call_request(device.device_id, tool, arguments, timeout_s, actor)
        self.counters["forwarded"] += 1
        try:
            try:
                await self.fabric.publish(
                    self.topics.rpc(device.owner),
                    wire.dumps(request),
                    response_topic=self.topics.reply(),
                    correlation=correlation,
                    expiry_s=math.ceil(wait_s),
                    timeout_s=BROKER_PROBE_TIMEOUT_S,
                )
            except FabricUnavailable as exc:
                raise DeviceDisconnected(
                    f"cannot reach bridge instance {device.owner}: {exc}"
                ) from None
            self._watch_broker()
            try:
                async with asyncio.timeout(wait_s):
                    reply = await future
            except TimeoutError:
                raise RequestTimeout("tools/call", budget, tool) from None
        except asyncio.CancelledError:
            self._spawn(self._cancel(device.owner, correlation))
            raise
        finally:
            self._pending.pop(correlation, None)
        return wire.parse_reply(reply)

    def _watch_broker(self) -> None:
        if self._broker_watch is None or self._broker_watch.done():
            self._broker_watch = asyncio.create_task(self._probe_while_waiting())

    async def _probe_while_waiting(self) -> None:
        while self._pending:
            await asyncio.sleep(BROKER_PROBE_EVERY_S)
            if not self._pending:
                return
            try:
                await self.fabric.probe(BROKER_PROBE_TIMEOUT_S)
            except FabricUnavailable as exc:
                failed = self._fail_pending(None, f"cluster broker not answering ({exc})")
                log.warning("cluster broker not answering", calls_failed=failed)

    async def _cancel(self, owner: str, correlation: bytes) -> None:
        with contextlib.suppress(FabricUnavailable):
            await self.fabric.publish(
                self.topics.rpc(owner),
                wire.dumps({"v": wire.VERSION, "op": "cancel"}),
                correlation=correlation,
            )

    def _on_reply(self, body: dict[str, Any], message: Inbound) -> None:
        if message.correlation is None:
            return
        pending = self._pending.get(message.correlation)
        if pending is not None and not pending[0].done():
            pending[0].set_result(body)

    # ---- forwarded calls: the owner's side ------------------------------------------------------

    def _on_request(self, body: dict[str, Any], message: Inbound) -> None:
        correlation = message.correlation
        if correlation is None:
            log.warning("forwarded request without correlation data dropped")
            return
        if body.get("op") == "cancel":
            task = self._serving.get(correlation)
            if task is not None:
                task.cancel()
            return
        if body.get("op") != "call" or correlation in self._serving:
            return  # unknown, or a duplicate delivery (QoS 1)
        if message.response_topic is None:
            log.warning("forwarded call without a response topic dropped")
            return
        task = asyncio.create_task(self._serve(body, message.response_topic, correlation))
        self._serving[correlation] = task
        task.add_done_callback(lambda _t: self._serving.pop(correlation, None))

    async def _serve(self, body: dict[str, Any], reply_to: str, correlation: bytes) -> None:
        self.counters["served"] += 1
        try:
            reply = wire.result_reply(await self._call_local(body))
        except asyncio.CancelledError:
            return  # the caller gave up; the device call was cancelled with it
        except (DeviceLayerError, McpError) as exc:
            reply = wire.error_reply(exc)
        except Exception as exc:
            log.error("forwarded call failed", error=repr(exc))
            reply = wire.error_reply(DeviceDisconnected(f"error on the owning instance: {exc}"))
        with contextlib.suppress(FabricUnavailable):
            await self.fabric.publish(reply_to, wire.dumps(reply), correlation=correlation)

    async def _call_local(self, body: dict[str, Any]) -> CallResult:
        device_id, tool = body.get("device_id"), body.get("tool")
        arguments, timeout_s = body.get("arguments"), body.get("timeout_s")
        actor = body.get("actor")
        if not isinstance(device_id, str) or not isinstance(tool, str):
            raise UnknownDevice(str(device_id))
        if not isinstance(arguments, dict):
            arguments = {}
        device: Device | None = self.registry.get(device_id)
        if device is None and self.registry.is_moving(device_id):
            # Told to reconnect (a drain, a rebalance) just as the call came: it is served by its
            # new owner once ready there (one more hop; the caller's view had not caught up).
            device = await self.registry.require_ready(device_id)
        if device is None:  # it left this instance meanwhile: never forward again (no loops)
            raise DeviceOffline(device_id)
        return await device.call_tool(
            tool,
            arguments,
            timeout_s=float(timeout_s) if isinstance(timeout_s, int | float) else None,
            confirmed=True,  # the caller's instance asked for the confirmation already
            actor=actor if isinstance(actor, str) else None,
        )

    def health(self) -> str | None:
        """Why this instance should get no new devices now, or None (for `/healthz`)."""
        if self.draining:
            return "draining"
        if self.fenced:
            return "cut off from the database"
        if not self._fleet_view_whole():
            return "joining: waiting for the other instances' devices"
        return None

    # ---- status ---------------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Instances (alive, draining, heartbeat lag, devices), leases and shards, as the
        database and this instance see them."""
        now = time.time()
        instances = await self.leases.instances()
        leases = await self.leases.leases()
        by_owner: dict[str, int] = {}
        expired = 0
        for lease in leases:
            if lease.expires_at < now:
                expired += 1
            else:
                by_owner[lease.instance_id] = by_owner.get(lease.instance_id, 0) + 1
        shards = await self.leases.shard_owners() if self.options.shards > 1 else {}
        return {
            "instance": self.instance_id,
            "fenced": self.fenced,
            "draining": self.draining,
            "broker_connected": self.fabric.connected,
            "lease_ttl_s": self.options.ttl_s,
            "instances": [
                {
                    "instance_id": row.instance_id,
                    "api_url": row.api_url,
                    "alive": row.heartbeat_at > 0 and now - row.heartbeat_at < self.options.ttl_s,
                    "draining": row.draining,
                    "heartbeat_lag_s": round(now - row.heartbeat_at, 3)
                    if row.heartbeat_at
                    else None,
                    "devices": by_owner.get(row.instance_id, 0),
                    "shards": sorted(
                        s
                        for s, (owner, exp) in shards.items()
                        if owner == row.instance_id and exp >= now
                    ),
                }
                for row in instances
            ],
            "leases": {"live": sum(by_owner.values()), "expired": expired},
            "fleet": {
                "local": len(self.registry),
                "remote": len(self.registry.remote_devices()),
            },
            "counters": dict(self.counters),
            "drain": self.drain_progress.as_dict() if self.drain_progress is not None else None,
            "rebalanced": self.rebalancer.moved,
        }

    # ---- read by the metrics (backend/metrics: bridge_cluster_*) ------------------------------

    @property
    def renew_lag_s(self) -> float:
        """Seconds since the start of the last successful lease renewal."""
        return max(0.0, time.monotonic() - self._renewed_at)

    @property
    def broker_connected(self) -> bool:
        """Whether this instance's connection to the cluster broker is up."""
        return self.fabric.connected

    @property
    def devices_owned(self) -> int:
        """How many devices are connected to this instance (its local devices)."""
        return len(self.registry)
