"""The admin and metrics listeners' bounds (backend/api/listener.py, issue #32 item 3): idle and
partial request heads closed by the head deadline, a per-address connection cap that leaves other
addresses served, and an accept loop that pauses instead of spinning when the process runs out of
descriptors, then recovers. Real loopback sockets against real bridges."""

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from backend.server import Bridge
from testkit.processes import WatchedProcess
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from tests.helpers import can_bind, eventually

REPO = Path(__file__).resolve().parent.parent


def _open(port: int, source: str | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if source is not None:
        sock.bind((source, 0))
    sock.settimeout(10)  # recv runs in a thread: the bridge shares this event loop
    sock.connect(("127.0.0.1", port))
    return sock


async def _closed_by_peer(sock: socket.socket, within_s: float) -> float:
    """Seconds until the bridge closes `sock` (EOF or reset); fails after `within_s`."""
    began = time.monotonic()

    def wait() -> None:
        sock.settimeout(within_s)
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass

    await asyncio.to_thread(wait)
    return time.monotonic() - began


async def test_idle_sockets_are_closed_after_the_head_deadline(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(http_head_timeout_s=0.5)
    assert bridge.api_listener is not None
    idle = [_open(bridge.http_port) for _ in range(20)]
    try:
        await eventually(lambda: len(bridge.api_listener.guard.pending) == 20)  # type: ignore[union-attr]
        waits = await asyncio.gather(*(_closed_by_peer(sock, 5.0) for sock in idle))
        assert max(waits) < 4.0
        await eventually(lambda: not bridge.api_listener.guard.pending)  # type: ignore[union-attr]
    finally:
        for sock in idle:
            sock.close()
    async with httpx.AsyncClient(base_url=bridge.api_url, timeout=5) as client:
        assert (await client.get("/healthz")).status_code == 200


async def test_a_partial_head_is_closed_and_an_idle_keep_alive_too(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(http_head_timeout_s=0.5, http_keep_alive_s=0.5)
    partial = _open(bridge.http_port)
    kept = _open(bridge.http_port)
    try:
        partial.sendall(b"GET /healthz HTTP/1.1\r\nHost: bridge\r\nX-Slow: ")
        # A whole request is answered; the connection, kept alive, then idles and is closed.
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: bridge\r\n\r\n")
        kept.settimeout(5)
        assert (await asyncio.to_thread(kept.recv, 4096)).startswith(b"HTTP/1.1 200")
        assert await _closed_by_peer(partial, 5.0) < 4.0
        assert await _closed_by_peer(kept, 5.0) < 4.0
    finally:
        partial.close()
        kept.close()


async def test_a_head_that_never_ends_is_cut_at_its_size_cap(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(http_head_timeout_s=30)
    sock = _open(bridge.http_port)
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: bridge\r\n")
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            for _ in range(200):  # 200 KiB of headers, never a blank line
                sock.sendall(b"X-Junk: " + b"a" * 1014 + b"\r\n")
        assert await _closed_by_peer(sock, 5.0) < 4.0
    finally:
        sock.close()


@pytest.mark.skipif(not can_bind("127.0.0.2"), reason="needs 127.0.0.2 as another address")
async def test_past_the_per_address_cap_only_that_address_is_refused(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(
        rate_limit_exempt=[],  # loopback counts as the LAN here
        http_max_connections_per_address=4,
        http_head_timeout_s=30,
        metrics_port=0,
    )
    assert bridge.api_listener is not None and bridge.metrics_listener is not None
    metrics = bridge.metrics_listener.listener
    assert metrics is not None
    held = [_open(bridge.http_port, "127.0.0.2") for _ in range(4)]
    held += [_open(metrics.port, "127.0.0.2") for _ in range(4)]
    try:
        await eventually(lambda: len(bridge.api_listener.guard.pending) == 4)  # type: ignore[union-attr]
        await eventually(lambda: len(metrics.guard.pending) == 4)
        for port in (bridge.http_port, metrics.port):
            refused = _open(port, "127.0.0.2")
            try:
                assert await _closed_by_peer(refused, 5.0) < 2.0  # dropped at once
            finally:
                refused.close()
        # Another address is still served, on both listeners.
        async with httpx.AsyncClient(timeout=5) as client:
            assert (await client.get(f"{bridge.api_url}/healthz")).status_code == 200
            scrape = await client.get(
                bridge.metrics_listener.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
            )
            assert scrape.status_code == 200
        assert bridge.api_listener.guard.refused >= 1 and metrics.guard.refused >= 1
    finally:
        for sock in held:
            sock.close()
    # Their places are given back once they close.
    await eventually(lambda: not bridge.api_listener.guard.pending)  # type: ignore[union-attr]
    again = _open(bridge.http_port, "127.0.0.2")
    try:
        again.sendall(b"GET /healthz HTTP/1.1\r\nHost: bridge\r\n\r\n")
        assert (await asyncio.to_thread(again.recv, 4096)).startswith(b"HTTP/1.1 200")
    finally:
        again.close()


# A bridge with a low descriptor limit, most of it already taken: a few idle sockets exhaust it.
_LOW_LIMIT_CHILD = """
import os, resource, runpy, sys
LIMIT, FREE = 256, 90
resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
in_use = len(os.listdir("/proc/self/fd"))
hog = [os.open("/dev/null", os.O_RDONLY) for _ in range(LIMIT - in_use - FREE)]
sys.argv = ["esp32-bridge", "serve", "--data-dir", sys.argv[1], "--ws-port", "0",
            "--http-port", "0", "--device-http-port", "0"]
runpy.run_module("backend.cli", run_name="__main__")
"""


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc")
async def test_out_of_descriptors_the_bridge_pauses_accepting_and_recovers(
    tmp_path: Path,
) -> None:
    env = {
        **os.environ,
        "BRIDGE_ADMIN_TOKEN": ADMIN_TOKEN,
        "BRIDGE_DEVICE_TOKEN": DEVICE_TOKEN,
        "BRIDGE_DEVICE_AUTH": "shared",
        "BRIDGE_LOG_FORMAT": "json",
        "BRIDGE_VOICE_ENABLED": "false",
        "BRIDGE_LLM_PROVIDER": "none",
        "BRIDGE_SEARCH_ENABLED": "false",
        "BRIDGE_HTTP_HEAD_TIMEOUT_S": "30",  # the idle sockets stay until the test closes them
    }
    child = WatchedProcess([sys.executable, "-c", _LOW_LIMIT_CHILD, str(tmp_path)], env, REPO)
    await child.start()
    idle: list[socket.socket] = []
    try:
        runtime = tmp_path / "bridge.json"
        await child.wait_for(runtime.exists, "the runtime file")
        api_url = json.loads(runtime.read_text())["api_url"]
        port = int(api_url.rsplit(":", 1)[1])
        assert child.process is not None
        bridge = psutil.Process(child.process.pid)
        descriptors_before = bridge.num_fds()
        for _ in range(200):  # more than the descriptors left: the rest wait in the kernel
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            idle.append(sock)
        await child.wait_for(
            lambda: any("accepting paused" in line for line in child.lines), "an accept pause", 10
        )
        assert bridge.num_fds() > 200  # the limit is reached (256)
        cpu_before, began = sum(bridge.cpu_times()[:2]), time.monotonic()
        await asyncio.sleep(3)
        busy = (sum(bridge.cpu_times()[:2]) - cpu_before) / (time.monotonic() - began)
        assert busy < 0.5, f"the bridge used {busy:.0%} of a core while out of descriptors"
        pauses = [line for line in child.lines if "accepting paused" in line]
        assert len(pauses) == 1  # once per burst
        for sock in idle:
            sock.close()
        idle.clear()
        async with httpx.AsyncClient(timeout=2) as client:
            deadline = time.monotonic() + 20
            while True:
                try:
                    if (await client.get(f"{api_url}/healthz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "/healthz did not answer again"
                await asyncio.sleep(0.2)
        await child.wait_for(
            lambda: any("accepting again" in line for line in child.lines), "accepting again", 10
        )
        await child.wait_for(
            lambda: bridge.num_fds() <= descriptors_before + 5, "the descriptors back", 10
        )
    finally:
        for sock in idle:
            sock.close()
        await child.stop()
