"""Benchmark: the MQTT + UDP transport end to end.

1. `tools/call` round trip (`Device.call_tool` in the bridge, to the device's MCP server and back)
   over MQTT through a real Mosquitto and through the embedded endpoint, against the WebSocket
   path in the same run. Every device is a simulated device (the firmware's own app loop, MCP
   server and transport modules) started the way a user starts one, `esp32-bridge simulate`, in
   a process of its own; the bridges run in this process. The three paths take turns in rounds
   of calls, so that machine noise hits all of them alike.
2. N MQTT devices (`simulate --transport mqtt --devices N`) online and ready through one
   Mosquitto and one bridge: time from launching the command to the N-th READY, and the bridge's
   memory per device (RSS delta of this process, which is the bridge, / N).
"""

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil

from bench.common import (
    ADMIN_TOKEN,
    DEVICE_TOKEN,
    REPO,
    VOLUME_TOOL,
    Stats,
    bench_main,
    bench_settings,
    kib,
    ms,
    quiet_logging,
    raise_open_files,
    ratio,
    table,
    verdict,
)
from bench.report import environment

NAME = "mqtt"
SECRET = "bench-mqtt-secret-0123456789abcdef"
CALLS_FULL, CALLS_QUICK = 3000, 60
ROUND = 20
DEVICES_FULL, DEVICES_QUICK = 1000, 50
TARGET_RATIO = 2.0
TARGET_READY_S = 10.0
TARGET_KIB = 40.0


# ---- Mosquitto ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def mosquitto(device_ids: list[str]) -> AsyncIterator[tuple[int, str]]:
    """A Mosquitto on a free loopback port with the bridge's and the devices' logins; yields
    (port, the bridge's broker URL)."""
    import shutil
    import socket

    from backend.transports.mqtt_credentials import (
        BridgeAccount,
        DerivedCredentials,
        mosquitto_acl,
        mosquitto_conf,
        write_mosquitto_password_file,
    )

    executable = shutil.which("mosquitto", path="/usr/sbin:/usr/bin:/sbin") or "mosquitto"
    credentials = DerivedCredentials(SECRET.encode())
    bridge = BridgeAccount()
    logins = [(bridge.username, bridge.password)]
    logins += [(c.username, c.password) for c in map(credentials.issue, device_ids)]
    with tempfile.TemporaryDirectory(prefix="bench-mosquitto-") as folder:
        work = Path(folder)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        passwords = write_mosquitto_password_file(work / "passwords", logins)
        (work / "acl").write_text(mosquitto_acl("xiaozhi", bridge.username))
        run_as = "root" if os.getuid() == 0 else None
        conf = mosquitto_conf(
            port=port, password_file=passwords, acl_file=work / "acl", run_as=run_as
        )
        (work / "mosquitto.conf").write_text(conf + "max_connections -1\n")
        process = await asyncio.create_subprocess_exec(
            executable, "-c", str(work / "mosquitto.conf"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            for _ in range(500):
                with contextlib.suppress(OSError):
                    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.close()
                    break
                await asyncio.sleep(0.02)
            url = f"mqtt://{bridge.username}:{bridge.password}@127.0.0.1:{port}"
            yield port, url
        finally:
            process.terminate()
            await asyncio.wait_for(process.wait(), 10)


# ---- bridges and simulated devices --------------------------------------------------------------


@contextlib.asynccontextmanager
async def bridge(data_dir: Path, **overrides: Any) -> AsyncIterator[Any]:
    from backend.auth import Tokens
    from backend.server import Bridge

    settings = bench_settings(
        data_dir,
        mqtt_host="127.0.0.1",
        mqtt_port=0,
        mqtt_secret=SECRET,
        udp_host="127.0.0.1",
        udp_port=0,
        init_timeout_s=30,
        **overrides,
    )
    async with Bridge(settings, Tokens(admin=ADMIN_TOKEN, device=DEVICE_TOKEN)) as running:
        yield running


@contextlib.asynccontextmanager
async def simulate(*args: str, data_dir: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """`esp32-bridge simulate ARGS` as its own process, stopped on exit."""
    env = {**os.environ, "BRIDGE_MQTT_SECRET": SECRET, "BRIDGE_DEVICE_TOKEN": DEVICE_TOKEN}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "backend.cli", "simulate", "--data-dir", str(data_dir), *args,
        cwd=REPO, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.terminate()
        await process.wait()


# ---- 1. round trip ------------------------------------------------------------------------------


async def round_trips(quick: bool) -> tuple[dict[str, Stats], dict[str, int]]:
    from simulator.fleet import device_id_for

    calls = CALLS_QUICK if quick else CALLS_FULL
    device_id = device_id_for(1)
    with tempfile.TemporaryDirectory(prefix="bench-mqtt-") as folder:
        work = Path(folder)
        async with (
            mosquitto([device_id]) as (port, mosquitto_url),
            bridge(work / "a", mqtt_url=mosquitto_url) as external,
            bridge(work / "b", mqtt_url="embedded") as embedded,
            simulate("--url", external.ws_url, "--first-index", "2", data_dir=work / "ws"),
            simulate("--transport", "mqtt", "--mqtt", f"mqtt://127.0.0.1:{port}", data_dir=work),
            simulate("--transport", "mqtt", "--mqtt", embedded.mqtt.device_url, data_dir=work),
        ):
            # The WebSocket and the Mosquitto device share the bridge `external`: two indexes.
            paths = {"websocket": external, "mqtt via mosquitto": external}
            paths["mqtt via the embedded endpoint"] = embedded
            ids = {"websocket": device_id_for(2), "mqtt via mosquitto": device_id}
            ids["mqtt via the embedded endpoint"] = device_id
            for name, running in paths.items():
                await wait_ready(running, ids[name])
            transports = {"websocket": "websocket", "mqtt via mosquitto": "mqtt"}
            transports["mqtt via the embedded endpoint"] = "mqtt"
            samples: dict[str, list[int]] = {name: [] for name in paths}
            # Warm-up, then interleaved rounds.
            for name, running in paths.items():
                await call_n(running, ids[name], transports[name], 10, [])
            while min(len(s) for s in samples.values()) < calls:
                for name, running in paths.items():
                    await call_n(running, ids[name], transports[name], ROUND, samples[name])
    return {name: Stats.of(s) for name, s in samples.items()}, {"calls": calls}


async def wait_ready(running: Any, device_id: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        device = running.registry.get(device_id)
        if device is not None and device.state.value == "ready":
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"{device_id} not ready")


async def call_n(running: Any, device_id: str, transport: str, count: int, out: list[int]) -> None:
    device = running.registry.get(device_id)
    if device is None or device.transport != transport:
        raise RuntimeError(f"{device_id} is not on {transport}")
    for n in range(count):
        start = time.perf_counter_ns()
        result = await device.call_tool(VOLUME_TOOL, {"volume": n % 100})
        out.append(time.perf_counter_ns() - start)
        if result.is_error:
            raise RuntimeError(f"tool call failed: {result.content}")


# ---- 2. many devices ----------------------------------------------------------------------------


async def fleet(quick: bool) -> dict[str, Any]:
    from simulator.fleet import device_id_for

    count = DEVICES_QUICK if quick else DEVICES_FULL
    ids = [device_id_for(i) for i in range(1, count + 1)]
    raise_open_files(4 * count + 1024)
    me = psutil.Process()
    with tempfile.TemporaryDirectory(prefix="bench-mqtt-fleet-") as folder:
        work = Path(folder)
        async with (
            mosquitto(ids) as (port, url),
            bridge(work / "bridge", mqtt_url=url) as running,
        ):
            await asyncio.sleep(0.5)
            before = me.memory_info().rss
            ready: set[str] = set()

            def on_event(event: Any) -> None:
                device = running.registry.get(event.device_id)
                if device is not None and device.state.value == "ready":
                    ready.add(event.device_id)

                if len(ready) == count:
                    all_ready.set()

            all_ready = asyncio.Event()
            unsubscribe = running.registry.subscribe(on_event)
            started = time.monotonic()
            args = ["--transport", "mqtt", "--mqtt", f"mqtt://127.0.0.1:{port}"]
            async with simulate(*args, "--devices", str(count), data_dir=work):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(all_ready.wait(), 120)
                elapsed = time.monotonic() - started
                unsubscribe()
                await asyncio.sleep(1.0)
                after = me.memory_info().rss
                online = len(running.registry)
    return {
        "count": count,
        "ready": len(ready),
        "online": online,
        "seconds": elapsed,
        "per_device": (after - before) / count,
        "before": before,
        "after": after,
    }


# ---- report -------------------------------------------------------------------------------------


async def run(quick: bool) -> str:
    quiet_logging()
    stats, meta = await round_trips(quick)
    many = await fleet(quick)
    base = stats["websocket"]
    rows = [
        [name, ms(s.p50), ms(s.p99), ms(s.mean), ratio(s.p50, base.p50), s.count]
        for name, s in stats.items()
    ]
    mosq = stats["mqtt via mosquitto"]
    ratio_met = mosq.p50 <= TARGET_RATIO * base.p50
    ready_met = many["ready"] == many["count"] and many["seconds"] < TARGET_READY_S
    memory_met = many["per_device"] / 1024 < TARGET_KIB
    fleet_rows = [
        [
            many["count"],
            f"{many['seconds']:.2f}",
            many["ready"],
            kib(many["per_device"]),
            f"{many['before'] / 2**20:.1f} → {many['after'] / 2**20:.1f}",
        ]
    ]
    label = " (quick run: few samples)" if quick else ""
    return f"""## MQTT + UDP transport{label}

`python -m bench.mqtt`{" --quick" if quick else ""}. {environment()}

### `tools/call` round trip

`Device.call_tool("{VOLUME_TOOL}")` in the bridge to a simulated device (`esp32-bridge simulate`,
the firmware's own modules, in its own process) and back; {meta["calls"]} calls per path in
interleaved rounds of {ROUND}, after a warm-up. Mosquitto 2.0 with the generated config
(`set_tcp_nodelay true`); the embedded endpoint is the bridge itself (no broker hop).

{table(["path", "p50 ms", "p99 ms", "mean ms", "p50 / WebSocket", "calls"], rows)}

Target: MQTT through Mosquitto within {TARGET_RATIO:g}× WebSocket (p50):
{verdict(ratio_met)} ({ratio(mosq.p50, base.p50)}×).

### {many["count"]} MQTT devices through one Mosquitto and one bridge

From launching `esp32-bridge simulate --transport mqtt --devices {many["count"]}` to the last
READY (initialize and tools/list done); bridge memory = RSS of the bridge's process before the
fleet and 1 s after the last READY, per device = delta / N.

{table(["devices", "all ready (s)", "ready", "KiB per device", "bridge RSS MiB"], fleet_rows)}

Targets: all ready under {TARGET_READY_S:g} s: {verdict(ready_met)}
({many["seconds"]:.2f} s); under {TARGET_KIB:g} KiB per device: {verdict(memory_met)}
({kib(many["per_device"])} KiB).
"""


def main() -> None:
    bench_main(NAME, __doc__ or NAME, run)


if __name__ == "__main__":
    main()
