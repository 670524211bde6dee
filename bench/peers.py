"""The other ends of the benchmarks, each in its own process: `python -m bench.peers ROLE ...`.

Every role prints JSON lines on stdout, reads JSON commands on stdin and exits when stdin closes.

  echo           a bare `websockets` server that echoes every frame (same options as the bridge)
  device         simulated devices (the real firmware code), one per --url, until EOF; with
                 --with-echo also an echo server in the same process
  hello          a simulated device per {"cmd":"device"} (or the recorded exchange replayed by a
                 bare client per {"cmd":"replay"}); {"cmd":"stop"} reports when its hello frame
                 went out and how many tools/list requests the bridge sent it
  fleet          `simulator.run_fleet` of --count devices; reports when it started
  idle           --count idle connections of the firmware's WebSocket client
  bridge         a Bridge; reports its URLs, then the time its --expect'th device became ready
  ota_bridge     a Bridge with per-device tokens and --count devices approved; reports its URLs
                 and pid; {"cmd":"stats"} reports pending activations, approved devices, RSS
"""

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench.common import DEVICE_TOKEN, quiet_logging, raise_open_files, server_options


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def commands() -> AsyncIterator[dict[str, Any]]:
    """JSON commands from stdin until EOF."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        yield json.loads(line)


async def until_eof() -> None:
    """Serve {"cmd":"cpu"} (CPU seconds used so far) until stdin closes."""
    async for command in commands():
        answer(command)


def answer(command: dict[str, Any]) -> None:
    if command.get("cmd") == "cpu":
        report(cpu=time.process_time())


# ---- roles ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[str]:
    """A bare `websockets` echo server; yields its URL."""
    from websockets.asyncio.server import ServerConnection, serve
    from websockets.exceptions import ConnectionClosed

    async def handler(connection: ServerConnection) -> None:
        with contextlib.suppress(ConnectionClosed):  # clients may leave without a close frame
            async for message in connection:
                await connection.send(message)

    async with serve(handler, "127.0.0.1", 0, backlog=1024, **server_options()) as server:
        yield f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}/xiaozhi/v1/"


async def echo(_args: argparse.Namespace) -> None:
    async with echo_server() as url:
        report(url=url, pid=os.getpid())
        await until_eof()


async def device(args: argparse.Namespace) -> None:
    """Simulated devices, and with --with-echo an echo server in the same process: a baseline
    path and a measured path then share one process, wherever the OS runs it."""
    from simulator import SimulatedDevice

    devices = [
        SimulatedDevice(url, args.token, args.first_index + i, extra_tools=args.extra_tools)
        for i, url in enumerate(args.url)
    ]
    for each in devices:
        each.start()
    async with contextlib.AsyncExitStack() as stack:
        echo_url = await stack.enter_async_context(echo_server()) if args.with_echo else None
        report(device_ids=[each.device_id for each in devices], echo_url=echo_url)
        await until_eof()
    await _stop_all(devices)


def _timed_transport() -> type:
    """The firmware's WebSocket client, noting its hello send time and tools/list requests."""
    from simulator.firmware import firmware_module

    base = firmware_module("transport_ws").WsTransport

    class TimedTransport(base):  # type: ignore[misc, valid-type]
        hello_at: int | None = None
        tools_list_requests = 0

        async def send(self, message: Any) -> None:
            if self.hello_at is None and isinstance(message, str) and '"hello"' in message:
                TimedTransport.hello_at = time.monotonic_ns()
            await super().send(message)

        async def receive(self) -> Any:
            message = await super().receive()
            if isinstance(message, str) and '"tools/list"' in message:
                payload = json.loads(message).get("payload") or {}
                if payload.get("method") == "tools/list":
                    TimedTransport.tools_list_requests += 1
            return message

    return TimedTransport


async def hello(args: argparse.Namespace) -> None:
    """{"cmd":"device"}: a fresh simulated device; {"cmd":"replay"}: the recorded device frames
    over a bare `websockets` client; {"cmd":"stop"}: close it and report when its hello went out.
    Both kinds run in this one process, so the measured path and its baseline share a CPU."""
    from websockets.asyncio.client import connect

    from simulator import SimulatedDevice

    device: Any = None
    transport: Any = None
    replay: Any = None
    hello_at = 0
    async for command in commands():
        if command["cmd"] == "device":
            transport = _timed_transport()
            device = SimulatedDevice(args.url, args.token, 1, extra_tools=args.extra_tools)
            device.app.transport_factory = transport
            device.start()
        elif command["cmd"] == "replay":
            replay = await connect(args.replay_url, compression=None, max_size=None)
            hello_at = time.monotonic_ns()
            await _replay(replay, args.steps)
        elif command["cmd"] == "stop" and device is not None:
            await device.stop()
            device = None
            report(hello_at=transport.hello_at, tools_list_requests=transport.tools_list_requests)
        elif command["cmd"] == "stop":
            await replay.close()
            report(hello_at=hello_at)
    if device is not None:
        await device.stop()


async def _replay(connection: Any, steps: list[dict[str, Any]]) -> None:
    """The device side of a recorded exchange: wait for N frames, send the next ones, ..."""
    for step in steps:
        for _ in range(step["wait_for"]):
            await connection.recv()
        for text in step["send"]:
            await connection.send(text)


async def fleet(args: argparse.Namespace) -> None:
    from simulator import run_fleet

    raise_open_files(args.count + 256)
    started_at = time.monotonic_ns()
    devices = await run_fleet(args.url, args.token, args.count)
    report(started_at=started_at, launched_at=time.monotonic_ns())
    await until_eof()
    # Leave without a closing handshake per link: the server sees them all drop at once.
    del devices
    os._exit(0)


async def idle(args: argparse.Namespace) -> None:
    from simulator.firmware import firmware_module

    transport_ws = firmware_module("transport_ws")
    protocol = firmware_module("protocol")
    raise_open_files(args.count + 256)
    started_at = time.monotonic_ns()
    links = []
    for index in range(args.count):
        headers = protocol.handshake_headers(DEVICE_TOKEN, f"02:00:00:00:{index:05x}", "idle")
        links.append(transport_ws.WsTransport(args.url, headers))
    await asyncio.gather(*(link.connect() for link in links))
    report(connected=len(links), started_at=started_at, done_at=time.monotonic_ns())
    await until_eof()
    os._exit(0)


async def bridge(args: argparse.Namespace) -> None:
    from backend.devices import DeviceEvent, EventKind
    from backend.runtime import tune_gc_for_many_devices
    from bench.common import running_bridge

    raise_open_files(args.expect + 256)
    ready: set[str] = set()
    done = asyncio.Event()
    all_ready_at: list[int] = []

    def on_event(event: DeviceEvent) -> None:
        if event.kind is EventKind.READY and event.device_id not in ready:
            ready.add(event.device_id)
            if len(ready) == args.expect:
                all_ready_at.append(time.monotonic_ns())
                done.set()

    async with running_bridge() as running:
        if os.environ.get("BENCH_DEFAULT_GC") != "1":
            tune_gc_for_many_devices()  # as `esp32-bridge serve` does
        running.registry.subscribe(on_event)
        report(ws_url=running.ws_url, api_url=running.api_url, pid=os.getpid())
        eof = asyncio.ensure_future(until_eof())
        waiting = asyncio.ensure_future(done.wait())
        await asyncio.wait({eof, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if done.is_set():
            report(all_ready_at=all_ready_at[0], ready=len(ready))
            await eof
        waiting.cancel()


async def ota_bridge(args: argparse.Namespace) -> None:
    import psutil

    from backend.runtime import tune_gc_for_many_devices
    from bench.common import running_bridge

    raise_open_files(4096)
    # The load reuses --count device ids thousands of times a second: their per-device OTA
    # limit (a real device checks at boot) would refuse it, so it is lifted here.
    unlimited = {"per_s": 1e9, "burst": 10**9}
    async with running_bridge(
        device_auth="device",
        device_http_max_connections=4096,
        rate_limits={"ota_device": unlimited},
    ) as running:
        tune_gc_for_many_devices()  # as `esp32-bridge serve` does
        store = running.provisioning.store
        for index in range(args.count):
            await store.grant(known_device(index), known_client(index), by="bench")
        report(ota_url=running.provisioning.ota_url, api_url=running.api_url, pid=os.getpid())
        async for command in commands():
            if command.get("cmd") == "stats":
                report(
                    pending=store.pending_count,
                    approved=len(store.devices()),
                    rss=psutil.Process().memory_info().rss,
                )
            else:
                answer(command)


def known_device(index: int) -> str:
    return "a4:cf:01:" + ":".join(f"{byte:02x}" for byte in index.to_bytes(3, "big"))


def known_client(index: int) -> str:
    return f"00000000-0000-4000-8000-{index:012x}"


async def _stop_all(devices: list[Any]) -> None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(5):
            await asyncio.gather(*(each.stop() for each in devices), return_exceptions=True)


ROLES = {
    "echo": echo,
    "device": device,
    "hello": hello,
    "fleet": fleet,
    "idle": idle,
    "bridge": bridge,
    "ota_bridge": ota_bridge,
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peers")
    parser.add_argument("role", choices=sorted(ROLES))
    parser.add_argument("--url", action="append", default=[])
    parser.add_argument("--token", default=DEVICE_TOKEN)
    parser.add_argument("--first-index", type=int, default=1)
    parser.add_argument("--extra-tools", type=int, default=0)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--expect", type=int, default=1)
    parser.add_argument("--script", default="")
    parser.add_argument("--replay-url", default="")
    parser.add_argument("--with-echo", action="store_true")
    args = parser.parse_args()
    if args.role in ("hello", "fleet", "idle"):
        args.url = args.url[0]
    args.steps = json.loads(Path(args.script).read_text()) if args.script else []
    quiet_logging()
    if os.environ.get("BENCH_UVLOOP") == args.role:
        import uvloop

        uvloop.run(ROLES[args.role](args))
        return
    asyncio.run(ROLES[args.role](args))


if __name__ == "__main__":
    main()
