"""Moving devices between instances without failing calls: hitless drain and rebalancing
(docs/cluster.md, "Drain and rolling upgrade", "Rebalancing").

- **The shedder** asks devices of this instance to reconnect (WebSocket close 1012, "service
  restart") at a bounded rate, each one only once its tool calls in flight have finished (or
  their deadline passed): the device lands, through the balancer, on another instance. A drain
  and a rebalance both use it.
- **A drain** first waits for the balancer to notice (this instance's readiness answers 503 as
  soon as it drains), keeping its devices meanwhile, then gives up its MQTT shards and sheds
  every device.
- **Rebalancing**: at each renewal an instance holding clearly more than its fair share of the
  fleet (more than share × (1 + tolerance), and at least `MIN_EXCESS` devices over it) sheds a
  few devices, never below the fair share; `balance leastconn` sends them to the emptiest
  instance.
- **Shard targets** sum to the shard count: instances ranked by id, the first `shards % n` get
  one more.

The arithmetic is pure functions, unit-tested in tests/test_cluster_balance.py.
"""

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from backend.devices.device import Device
from backend.devices.registry import DeviceRegistry
from backend.devices.state import DeviceState

log = structlog.get_logger("cluster")

SERVICE_RESTART = 1012  # WebSocket close code: "reconnect, the service is restarting"
REBALANCE_TOLERANCE = 0.10  # shed only above the fair share × 1.1 ...
MIN_EXCESS = 3  # ... and at least this many devices over it (a few devices never bounce)
_IDLE_POLL_S = 0.01


# ---- the arithmetic ----------------------------------------------------------------------------


def fair_share(total: int, instances: int) -> float:
    """Devices per instance if `total` were spread evenly over `instances` (at least one)."""
    return total / max(instances, 1)


def rebalance_excess(
    mine: int,
    total: int,
    instances: int,
    *,
    tolerance: float = REBALANCE_TOLERANCE,
    min_excess: int = MIN_EXCESS,
) -> int:
    """How many of its `mine` devices an instance should shed, of a fleet of `total` over
    `instances` serving instances (itself included): 0 unless it holds more than
    share × (1 + tolerance) and at least `min_excess` over the share (hysteresis: an instance
    just above its share keeps its devices); then down to the share rounded up, never below."""
    if instances < 2 or mine <= 0:
        return 0
    share = fair_share(total, instances)
    if mine <= share * (1 + tolerance) or mine - share < min_excess:
        return 0
    return max(0, mine - math.ceil(share))


def shard_target(shards: int, instances: Iterable[str], me: str) -> int:
    """How many of `shards` MQTT shards instance `me` should own among the serving `instances`
    (`me` is counted even if absent): ranked by id, the first `shards % n` get one more than
    `shards // n`, so the targets sum to `shards` and no instance is left without one while
    another has two."""
    ranked = sorted({*instances, me})
    base, extra = divmod(shards, len(ranked))
    return base + (1 if ranked.index(me) < extra else 0)


def serving_instances(
    rows: Iterable[Any], me: str, now: float, ttl_s: float, *, me_serving: bool = True
) -> list[str]:
    """Ids of the instances that take devices: alive (heartbeat within `ttl_s`) and not
    draining (`InstanceRow`s); this instance is counted by `me_serving`, not by its row."""
    ids = {
        row.instance_id
        for row in rows
        if row.instance_id != me and not row.draining and now - row.heartbeat_at < ttl_s
    }
    if me_serving:
        ids.add(me)
    return sorted(ids)


# ---- the shedder -------------------------------------------------------------------------------


@dataclass
class DrainProgress:
    """How far a drain is (`GET /api/cluster` shows it; `cluster drain` polls it)."""

    phase: str = "notice"  # notice (the balancer is noticing) -> moving -> done
    started_at: float = 0.0
    devices_told: int = 0
    devices_left: int = 0
    finished_at: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """As `GET /api/cluster` shows it (`drain`)."""
        return {
            "phase": self.phase,
            "devices_told": self.devices_told,
            "devices_left": self.devices_left,
            "elapsed_s": round((self.finished_at or time.time()) - self.started_at, 3),
        }


class Shedder:
    """Asks devices of this instance to reconnect elsewhere, at most `rate_per_s` a second,
    each once it is idle (no tool call in flight) or `idle_wait_s` has passed."""

    def __init__(self, registry: DeviceRegistry, *, idle_wait_s: float) -> None:
        self.registry = registry
        self.idle_wait_s = idle_wait_s
        self.moved = 0  # devices told to reconnect, since start (drain and rebalance)

    async def shed(
        self,
        device_ids: Sequence[str],
        rate_per_s: float,
        reason: str,
        *,
        told: Callable[[int], None] | None = None,
    ) -> int:
        """Move these devices, one every 1/`rate_per_s` seconds, each waiting for its calls in
        flight; returns how many were told (a device gone meanwhile is not). `told(n)` is
        called after each."""
        interval = 1.0 / rate_per_s if rate_per_s > 0 else 0.0
        loop = asyncio.get_running_loop()
        start = loop.time()
        moves: list[asyncio.Task[bool]] = []
        count = 0

        def done(task: asyncio.Task[bool]) -> None:
            nonlocal count
            if not task.cancelled() and task.exception() is None and task.result():
                count += 1
                self.moved += 1
                if told is not None:
                    told(count)

        try:
            for index, device_id in enumerate(device_ids):
                delay = start + index * interval - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(self._move(device_id, reason))
                task.add_done_callback(done)
                moves.append(task)
            if moves:
                await asyncio.wait(moves)
        finally:
            for task in moves:
                task.cancel()
        return count

    async def _move(self, device_id: str, reason: str) -> bool:
        device = self.registry.get(device_id)
        if device is None:
            return False
        await self.wait_idle(device, self.idle_wait_s)
        # Checked and closed in one step of the loop: no call can start in between.
        if self.registry.get(device_id) is not device:
            return False
        return self.registry.disconnect(device_id, reason, SERVICE_RESTART)

    @staticmethod
    async def wait_idle(device: Device, timeout_s: float) -> bool:
        """Wait until no tool call to `device` is in flight (every call has a deadline, so this
        ends), at most `timeout_s`; False if it is still busy then."""
        deadline = time.monotonic() + timeout_s
        while device.is_live and device.mcp.pending_count > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_IDLE_POLL_S)
        return True


def sheddable(registry: DeviceRegistry, count: int) -> list[str]:
    """`count` devices of this instance to move for a rebalance: idle ready ones first, the most
    recently connected first (they have the least to lose)."""
    devices = [d for d in registry if d.state is DeviceState.READY]
    devices.sort(key=lambda d: (d.mcp.pending_count > 0, -d.connected_at))
    return [d.device_id for d in devices[:count]]


# After a rebalancing batch, wait this long for its devices to land (the firmware's reconnect
# pause, 1 s +-20 %, plus its handshake) before judging where they went; if most came back here,
# pause rebalancing this long.
LANDING_S = 3.0
BOUNCE_PAUSE_S = 600.0


class Rebalancer:
    """At each renewal: shed a few devices if this instance holds clearly more than its fair
    share (`rebalance_excess`), at most `rate_per_s` a second and one batch at a time (a batch is
    what that rate moves in one renewal interval, so every batch starts from fresh counts)."""

    def __init__(
        self,
        shedder: Shedder,
        instance_id: str,
        *,
        enabled: bool,
        rate_per_s: float,
        renew_s: float,
        ttl_s: float,
        spawn: Callable[[Any], None],
    ) -> None:
        self.shedder = shedder
        self.registry = shedder.registry
        self.instance_id = instance_id
        self.enabled = enabled
        self.rate_per_s = rate_per_s
        self.batch = max(1, math.ceil(rate_per_s * renew_s))
        self.ttl_s = ttl_s
        self._spawn = spawn
        self._busy = False
        self.moved = 0  # devices told to reconnect by rebalancing, since start
        # Bounce guard: where devices connect to this instance directly (no balancer, or one
        # pinned to it) the devices moved come back here; then moving more only churns.
        self._last_batch: list[str] = []
        self._last_batch_done = 0.0  # monotonic
        self.paused_until = 0.0  # monotonic

    def renewed(self, instances: Iterable[Any], *, serving: bool) -> None:
        """After a successful renewal (`instances`: every `InstanceRow`); `serving`: this
        instance takes devices and sees the fleet (not draining, fenced or off the broker)."""
        if not self.enabled or not serving or self._busy or self._bounced():
            return
        others = serving_instances(instances, self.instance_id, time.time(), self.ttl_s)
        mine = len(self.registry)
        total = mine + sum(1 for d in self.registry.remote_devices() if d.is_live)
        excess = rebalance_excess(mine, total, len(others))
        if excess <= 0:
            return
        device_ids = sheddable(self.registry, min(excess, self.batch))
        if not device_ids:
            return
        log.info(
            "rebalancing: moving devices to emptier instances",
            instance=self.instance_id,
            devices=mine,
            fleet=total,
            instances=len(others),
            moving=len(device_ids),
        )
        self._busy = True
        self._last_batch = device_ids
        self._spawn(self._shed(device_ids))

    def _bounced(self) -> bool:
        """Whether to hold off: the last batch's devices have not had time to land elsewhere, or
        most of them came back here (then pause for `BOUNCE_PAUSE_S`)."""
        now = time.monotonic()
        if now < self.paused_until:
            return True
        if not self._last_batch:
            return False
        if now - self._last_batch_done < LANDING_S:
            return True
        batch, self._last_batch = self._last_batch, []
        back = sum(1 for device_id in batch if self.registry.get(device_id) is not None)
        if back * 2 <= len(batch):
            return False
        self.paused_until = now + BOUNCE_PAUSE_S
        log.warning(
            "rebalancing paused: the devices moved came back to this instance (do they connect"
            " to it directly rather than through the balancer?)",
            instance=self.instance_id,
            moved=len(batch),
            came_back=back,
            pause_s=BOUNCE_PAUSE_S,
        )
        return True

    async def _shed(self, device_ids: list[str]) -> None:
        try:
            self.moved += await self.shedder.shed(
                device_ids, self.rate_per_s, "bridge instances rebalancing: reconnect"
            )
        finally:
            self._busy = False
            self._last_batch_done = time.monotonic()
