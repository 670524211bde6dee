"""Benchmark: the cluster through a database outage and a broker cut (issue #33), on this machine.

Three real `esp32-bridge serve` processes on one throwaway PostgreSQL and one Mosquitto, a fleet
of simulated devices (`python -m bench.peers fleet`, its own process) behind a layer-4 balancer;
the parts are `bench.cluster`'s. Calls go every 20 ms to the devices in turn, each through the
next instance (so two of three are forwarded over the broker).

1. PostgreSQL **stopped** (the server process, `pg_ctl stop -m fast`) for 30 s and for 90 s
   under that traffic, then started again: devices disconnected (new connections through the
   balancer), calls that failed during and after the outage, seconds from the restart until
   every instance answers `cluster status` again, and whether every device ends with exactly one
   lease held by the instance that lists it.
2. The broker **stopped** for 20 s under the same traffic: the slowest failure of a forwarded
   call during the cut (the figure the issue sets: within 1 s), devices disconnected, and
   seconds from the broker's restart until every instance lists the whole fleet ready again
   (the issue: within 2 s).
3. A **rolling restart**: each instance in turn gets SIGTERM (it drains hitlessly: readiness
   503, the notice wait, devices moved at a bounded rate once their calls finished), starts
   again on its data directory; calls go on through the other instances. Failed calls.
"""

import asyncio
import contextlib
import itertools
import json
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.cluster import (
    LEASE,
    NAMES,
    Fleetless,
    Infra,
    api,
    infrastructure,
    poll,
    running_instances,
    wait_all_alive,
)
from bench.common import bench_main, peer, quiet_logging, raise_open_files, table, verdict
from bench.report import environment
from testkit.cluster_processes import ADMIN_TOKEN, DEVICE_TOKEN, ServeInstance, instance_env
from testkit.haproxy import ADMIN_PORT, OTA_PORT, WS_PORT, HAProxy, InstancePorts

NAME = "cluster_outage"
CALL_EVERY_S = 0.02
FORWARD_FAIL_GOAL_S = 1.0
AGREE_GOAL_S = 2.0


@dataclass(frozen=True)
class Sizes:
    devices: int
    database_outages_s: tuple[float, ...]
    broker_outage_s: float


FULL = Sizes(300, (30.0, 90.0), 20.0)
QUICK = Sizes(30, (8.0,), 5.0)


@dataclass
class Calls:
    """Every call's start (monotonic), seconds, status and whether it was forwarded."""

    rows: list[tuple[float, float, int, bool]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # "status: error code" -> calls

    def between(self, start: float, end: float) -> list[tuple[float, float, int, bool]]:
        return [row for row in self.rows if start <= row[0] < end]


async def traffic(
    running: Fleetless, owners: dict[str, str], calls: Calls, away: set[str] | None = None
) -> None:
    """A volume call every 20 ms: each device in turn through each instance in turn, except
    the instances `away` (restarting: an API client behind the shipped balancer's API frontend
    is sent elsewhere). An instance's API address is read at each call (a restart changes it)."""
    names = list(running.instances)
    clients: dict[str, httpx.AsyncClient] = {}
    plan = itertools.cycle(itertools.product(sorted(owners), names))
    tasks: set[asyncio.Task[None]] = set()

    def client_of(name: str) -> httpx.AsyncClient:
        url = running.instances[name].api_url
        if url not in clients:
            clients[url] = api(running.instances[name])
        return clients[url]

    async def one(name: str, device_id: str, volume: int) -> None:
        began = time.monotonic()
        try:
            reply = await client_of(name).post(
                f"/api/devices/{device_id}/tools/call",
                json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": volume}},
            )
            status = reply.status_code
            if status != 200:
                with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                    what = f"{status}: {reply.json()['error']['code']}"
                    calls.errors[what] = calls.errors.get(what, 0) + 1
        except httpx.HTTPError as exc:
            status = 0
            what = f"0: {type(exc).__name__}"
            calls.errors[what] = calls.errors.get(what, 0) + 1
        calls.rows.append((began, time.monotonic() - began, status, owners[device_id] != name))

    try:
        for n in itertools.count():
            device_id, name = next(plan)
            if away and name in away:
                continue
            task = asyncio.create_task(one(name, device_id, n % 100))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(CALL_EVERY_S)
    finally:
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients.values():
            await client.aclose()


async def fleet_ready(instances: list[ServeInstance], devices: int) -> bool:
    """Every instance lists the whole fleet ready."""
    for instance in instances:
        async with api(instance) as http:
            page = await http.get("/api/devices", params={"state": "ready", "limit": 1})
            if int(page.json()["total"]) != devices:
                return False
    return True


async def owners_of(instance: ServeInstance) -> dict[str, str]:
    async with api(instance) as http:
        rows: list[dict[str, Any]] = []
        cursor = None
        while True:
            params: dict[str, Any] = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
            page = (await http.get("/api/devices", params=params)).json()
            rows += page["devices"]
            cursor = page.get("next_cursor")
            if not cursor:
                break
    return {row["device_id"]: row["instance"] for row in rows}


async def ready(instance: ServeInstance) -> bool:
    async with httpx.AsyncClient(base_url=instance.api_url, timeout=5) as http:
        return (await http.get("/readyz")).status_code == 200


async def statuses_answer(instances: list[ServeInstance]) -> bool:
    for instance in instances:
        async with api(instance) as http:
            if (await http.get("/api/cluster")).status_code != 200:
                return False
    return True


async def leases_whole(instances: list[ServeInstance], devices: int) -> bool:
    """Each device has one live lease, held by the instance that lists it as its own."""
    async with api(instances[0]) as http:
        status = (await http.get("/api/cluster")).json()
    by_instance = {row["instance_id"]: row["devices"] for row in status["instances"]}
    owners = await owners_of(instances[0])
    listed = {name: sum(1 for owner in owners.values() if owner == name) for name in by_instance}
    return status["leases"]["live"] == devices and by_instance == listed


@dataclass(frozen=True)
class Outage:
    what: str
    seconds: float
    devices: int
    disconnected: int
    calls_during: int
    failed_during: int
    calls_after: int
    failed_after: int
    slowest_forwarded_failure_s: float | None
    recovered_s: float
    whole: bool
    closed_because: dict[str, int]  # why the bridges closed device links, from their logs


async def outage_run(infra: Infra, sizes: Sizes, what: str, seconds: float) -> Outage:
    devices = sizes.devices
    async with (
        running_instances(infra, 3, f"{what}{seconds:g}") as running,
        peer("fleet", "--url", running.balancer.url, "--count", devices, "--token", DEVICE_TOKEN),
    ):
        instances = list(running.instances.values())
        await poll(lambda: fleet_ready(instances, devices), 300, "fleet ready", 0.2)
        owners = await owners_of(instances[0])
        connections = sum(running.balancer.connections.values())
        calls = Calls()
        caller = asyncio.create_task(traffic(running, owners, calls))
        await asyncio.sleep(2.0)  # traffic before the cut
        cut_at = time.monotonic()
        if what == "postgres":
            await asyncio.to_thread(infra.postgres.stop)
        else:
            await infra.broker.stop()
        await asyncio.sleep(seconds)
        back_at = time.monotonic()
        if what == "postgres":
            await asyncio.to_thread(infra.postgres.start)
            await poll(lambda: statuses_answer(instances), 120, "cluster status again", 0.1)
        else:
            await infra.broker.start()
            await poll(lambda: fleet_ready(instances, devices), 120, "listings agree", 0.05)
        recovered_s = time.monotonic() - back_at
        await asyncio.sleep(3.0)  # traffic after the return
        caller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await caller
        end = time.monotonic()
        await poll(lambda: fleet_ready(instances, devices), 60, "fleet ready after", 0.2)
        whole = await leases_whole(instances, devices)
        disconnected = sum(running.balancer.connections.values()) - connections
        closed_because = closure_reasons(instances)
    during = calls.between(cut_at, back_at)
    after = calls.between(back_at, end)
    failed_forwarded = [row[1] for row in during if row[2] != 200 and row[3]]
    return Outage(
        what,
        seconds,
        devices,
        disconnected,
        len(during),
        sum(1 for row in during if row[2] != 200),
        len(after),
        sum(1 for row in after if row[2] != 200),
        max(failed_forwarded) if failed_forwarded else None,
        recovered_s,
        whole,
        closed_because,
    )


def closure_reasons(instances: list[ServeInstance]) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for instance in instances:
        lines = instance.process.lines if instance.process is not None else []
        for line in lines:  # the bridges log JSON lines when not on a terminal
            if "closing the device's link" not in line:
                continue
            with contextlib.suppress(ValueError, AttributeError):
                reason = str(json.loads(line).get("reason"))
                reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


@dataclass(frozen=True)
class Rolling:
    devices: int
    seconds: float
    calls: int
    failed: int
    failed_forwarded: int
    whole: bool
    failures: dict[str, int]  # "status: error code" -> calls


async def frontend_traffic(url: str, device_ids: list[str], calls: Calls) -> None:
    """A volume call every 20 ms to each device in turn, through the balancer's API frontend."""
    tasks: set[asyncio.Task[None]] = set()
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:

        async def one(device_id: str, volume: int) -> None:
            began = time.monotonic()
            try:
                reply = await http.post(
                    f"/api/devices/{device_id}/tools/call",
                    json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": volume}},
                )
                status = reply.status_code
                if status != 200:
                    what = f"{status}: {reply.text[:80]}"
                    calls.errors[what] = calls.errors.get(what, 0) + 1
            except httpx.HTTPError as exc:
                status = 0
                what = f"0: {type(exc).__name__}"
                calls.errors[what] = calls.errors.get(what, 0) + 1
            calls.rows.append((began, time.monotonic() - began, status, False))

        try:
            for n, device_id in enumerate(itertools.cycle(device_ids)):
                task = asyncio.create_task(one(device_id, n % 100))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(CALL_EVERY_S)
        finally:
            await asyncio.gather(*tasks, return_exceptions=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def rolling_run(infra: Infra, sizes: Sizes) -> Rolling:
    """Behind a real HAProxy running the shipped deploy/haproxy.cfg (testkit/haproxy.py: only its
    bind and server lines rewritten): SIGTERM each instance in turn (it drains hitlessly, then
    stops), start it again on its data directory and ports, wait until it is alive, then the
    next one; calls every 20 ms throughout through HAProxy's API frontend."""
    devices = sizes.devices
    database_url = infra.postgres.new_database()
    ports = {name: (free_port(), free_port(), free_port()) for name in NAMES}
    instances = {
        name: ServeInstance(
            name,
            infra.workdir / "rolling" / name,
            instance_env(name, database_url, infra.broker.url_of(infra.accounts[name]), **LEASE),
            ports=ports[name],
        )
        for name in NAMES
    }
    binds = {WS_PORT: free_port(), OTA_PORT: free_port(), ADMIN_PORT: free_port()}
    servers = {
        f"bridge-{name}": InstancePorts({WS_PORT: ws, ADMIN_PORT: admin, OTA_PORT: ota})
        for name, (ws, admin, ota) in ports.items()
    }
    haproxy = HAProxy.shipped(infra.workdir / "rolling" / "haproxy", servers, binds)
    caller: asyncio.Task[None] | None = None
    try:
        await asyncio.gather(*(instance.start() for instance in instances.values()))
        every = list(instances.values())
        await wait_all_alive(every)
        await haproxy.start(binds[WS_PORT])
        url = f"ws://127.0.0.1:{binds[WS_PORT]}/xiaozhi/v1/"
        async with peer("fleet", "--url", url, "--count", devices, "--token", DEVICE_TOKEN):
            await poll(lambda: fleet_ready(every, devices), 300, "fleet ready", 0.2)
            calls = Calls()
            api_url = f"http://127.0.0.1:{binds[ADMIN_PORT]}"
            caller = asyncio.create_task(
                frontend_traffic(api_url, sorted(await owners_of(every[0])), calls)
            )
            began = time.monotonic()
            for name, instance in instances.items():
                await instance.stop()
                await instance.start()
                await wait_all_alive(every)
                await poll(lambda i=instance: ready(i), 30, f"{name} ready")
                await asyncio.sleep(4.5)  # HAProxy's `rise 2` at `inter 2s`: back in rotation
            await poll(lambda: fleet_ready(every, devices), 120, "fleet ready after", 0.2)
            seconds = time.monotonic() - began
            caller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await caller
            whole = await leases_whole(every, devices)
    finally:
        if caller is not None:
            caller.cancel()
        await haproxy.stop()
        await asyncio.gather(*(i.stop() for i in instances.values()), return_exceptions=True)
        infra.postgres.drop_database(database_url)
    failed = [row for row in calls.rows if row[2] != 200]
    return Rolling(devices, seconds, len(calls.rows), len(failed), 0, whole, calls.errors)


async def run(quick: bool) -> str:
    quiet_logging()
    sizes = QUICK if quick else FULL
    raise_open_files(4 * sizes.devices + 1024)
    load_before = os.getloadavg()[0]
    outages: list[Outage] = []
    async with infrastructure() as infra:
        for seconds in sizes.database_outages_s:
            outages.append(await outage_run(infra, sizes, "postgres", seconds))
        outages.append(await outage_run(infra, sizes, "broker", sizes.broker_outage_s))
        rolling = await rolling_run(infra, sizes)
    return render(sizes, outages, rolling, quick, (load_before, os.getloadavg()[0]))


HEADERS = [
    "cut",
    "devices",
    "disconnected",
    "failed during",
    "failed after",
    "slowest forwarded failure (s)",
    "recovered (s)",
    "leases whole",
]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(
    sizes: Sizes, outages: list[Outage], rolling: Rolling, quick: bool, load: tuple[float, float]
) -> str:
    rows = [
        [
            f"{o.what} stopped {o.seconds:g} s",
            str(o.devices),
            str(o.disconnected),
            f"{o.failed_during} / {o.calls_during}",
            f"{o.failed_after} / {o.calls_after}",
            _seconds(o.slowest_forwarded_failure_s),
            f"{o.recovered_s:.2f}",
            "yes" if o.whole else "**no**",
        ]
        for o in outages
    ]
    database = [o for o in outages if o.what == "postgres"]
    broker = [o for o in outages if o.what == "broker"]
    kept = all(o.disconnected == 0 and o.failed_during == 0 for o in database)
    whole = all(o.whole for o in outages)
    slowest = max((o.slowest_forwarded_failure_s or 0.0) for o in broker) if broker else 0.0
    agree = max((o.recovered_s for o in broker), default=0.0)
    mode = "quick" if quick else "full"
    lines = [
        f"Mode: {mode}; {environment()}; load average {load[0]:.2f} before, {load[1]:.2f} after.",
        "",
        "Three `serve` processes, one PostgreSQL, one Mosquitto, a volume call every "
        f"{CALL_EVERY_S * 1000:g} ms through the instances in turn (two of three forwarded). "
        "Disconnected: new device connections through the balancer. Recovered: PostgreSQL, "
        "seconds until every instance answers `cluster status`; broker, until every instance "
        "lists the whole fleet ready.",
        "",
        table(HEADERS, rows),
        "",
        "Goals (issue #33): PostgreSQL stopped, 0 devices disconnected and calls keep "
        f"succeeding: {verdict(kept)}; never a device live twice, leases whole afterwards: "
        f"{verdict(whole)}; broker stopped, forwarded calls fail within "
        f"{FORWARD_FAIL_GOAL_S:g} s: {verdict(slowest <= FORWARD_FAIL_GOAL_S)} "
        f"(slowest {slowest:.2f} s); listings agree within {AGREE_GOAL_S:g} s of its return: "
        f"{verdict(agree <= AGREE_GOAL_S)} ({agree:.2f} s).",
    ]
    for o in outages:
        if o.closed_because:
            closed = o.closed_because
            lines.append(f"\nLinks the bridges closed ({o.what} {o.seconds:g} s): {closed}")
    lines += [
        "",
        f"Rolling restart behind the shipped deploy/haproxy.cfg (SIGTERM: hitless drain, then "
        f"start again) of all three instances in turn, {rolling.devices} devices, calls every "
        f"{CALL_EVERY_S * 1000:g} ms through HAProxy's API frontend: {rolling.failed} of "
        f"{rolling.calls} calls failed over {rolling.seconds:.1f} s; leases whole "
        f"afterwards: {'yes' if rolling.whole else '**no**'}. Goal (issue #33): 0 failed "
        f"calls: {verdict(rolling.failed == 0)}."
        + (f" Failures: {rolling.failures}." if rolling.failures else ""),
    ]
    if broker:
        median = statistics.median([o.recovered_s for o in broker])
        lines.append(f"\nBroker return to agreement, median over runs: {median:.2f} s.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
