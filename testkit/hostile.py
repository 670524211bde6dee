"""Hostile devices: each attack a device holding only the device token could mount.

Used by tests/test_hostile.py (each attack against a live bridge, with its bound asserted) and
bench/reliability.py (the figures in docs/reliability.md). Every attack speaks real WebSocket to
the bridge like a stock device, then misbehaves; it runs for `duration_s` or until the bridge
cuts it off, and reports what it sent and how its link ended.

The MQTT attacks (against the bridge's embedded endpoint) are in `testkit.hostile_mqtt`, with
the same `AttackReport`; `python -m testkit.hostile_mqtt` runs one of them.
"""

import asyncio
import contextlib
import json
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

HELLO = {
    "type": "hello",
    "version": 1,
    "features": {"mcp": True},
    "transport": "websocket",
    "audio_params": {"format": "opus", "sample_rate": 16000, "channels": 1, "frame_duration": 60},
}
BIG = 60_000  # just under the 64 KiB frame limit


@dataclass
class AttackReport:
    name: str
    sent: int = 0
    seconds: float = 0.0
    close_code: int | None = None  # None: the link was still open when the attack ended
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def cut_off(self) -> bool:
        return self.close_code is not None


def headers(token: str, device_id: str, version: int = 1) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {token}",
        "Device-Id": device_id,
        "Client-Id": "00000000-0000-4000-8000-000000000bad",
        "Protocol-Version": str(version),
    }


async def open_device(
    url: str,
    token: str,
    device_id: str,
    *,
    answer_mcp: bool = True,
    tools: int = 1,
    version: int = 1,
) -> tuple[ClientConnection, asyncio.Task[None] | None]:
    """A link that said hello (binary framing `version`); with `answer_mcp`, a task answers
    initialize and tools/list."""
    ws = await connect(url, additional_headers=headers(token, device_id, version), compression=None)
    await ws.send(json.dumps(HELLO))
    await ws.recv()  # the server hello
    if not answer_mcp:
        return ws, None
    return ws, asyncio.create_task(_answer_handshake(ws, tools))


async def _answer_handshake(ws: ClientConnection, tools: int) -> None:
    declared = [
        {"name": f"evil.tool_{i}", "description": "", "inputSchema": {"type": "object"}}
        for i in range(tools)
    ]
    with contextlib.suppress(ConnectionClosed):
        async for frame in ws:
            if not isinstance(frame, str):
                continue
            payload = json.loads(frame).get("payload") or {}
            method, request_id = payload.get("method"), payload.get("id")
            if method == "initialize":
                result: Any = {"protocolVersion": "2024-11-05", "serverInfo": {"name": "evil"}}
            elif method == "tools/list":
                result = {"tools": declared}
            else:
                continue
            reply = {"jsonrpc": "2.0", "id": request_id, "result": result}
            await ws.send(json.dumps({"type": "mcp", "payload": reply}))


async def _run(
    name: str,
    ws: ClientConnection,
    duration_s: float,
    step: Callable[[int], Awaitable[None]],
    helper: asyncio.Task[None] | None = None,
) -> AttackReport:
    """Call `step(n)` as fast as the link takes it until the time is up or the link closes."""
    report = AttackReport(name)
    started = time.monotonic()
    try:
        while time.monotonic() - started < duration_s:
            await step(report.sent)
            report.sent += 1
            if report.sent % 64 == 0:
                await asyncio.sleep(0)  # let the helper task and the pings through
    except ConnectionClosed:
        pass
    report.seconds = time.monotonic() - started
    if helper is not None:
        helper.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await helper
    if ws.close_code is not None:
        report.close_code = ws.close_code
    elif ws.state.name != "OPEN":
        report.close_code = 1006
    else:
        await ws.close()
    return report


# ---- memory --------------------------------------------------------------------------------------


async def ping_flood(url: str, token: str, device_id: str, duration_s: float) -> AttackReport:
    """Requests with 60 KB ids, never reading the answers."""
    ws, helper = await open_device(url, token, device_id)
    await asyncio.sleep(0.2)  # let the MCP handshake finish
    if helper is not None:
        helper.cancel()  # from now on nothing is read
    big_id = "x" * BIG

    async def step(n: int) -> None:
        message = {"jsonrpc": "2.0", "id": f"{n}{big_id}", "method": "ping"}
        await ws.send(json.dumps({"type": "mcp", "payload": message}))

    return await _run("ping flood, 60 KB ids, never reading", ws, duration_s, step)


async def small_ping_flood(url: str, token: str, device_id: str, duration_s: float) -> AttackReport:
    """Small requests as fast as possible, never reading the answers."""
    ws, helper = await open_device(url, token, device_id)
    await asyncio.sleep(0.2)
    if helper is not None:
        helper.cancel()

    async def step(n: int) -> None:
        message = {"jsonrpc": "2.0", "id": n, "method": "ping"}
        await ws.send(json.dumps({"type": "mcp", "payload": message}))

    return await _run("ping flood, never reading", ws, duration_s, step)


async def list_changed_storm(
    url: str, token: str, device_id: str, duration_s: float
) -> AttackReport:
    """`notifications/tools/list_changed` at line rate while answering every tools/list."""
    ws, helper = await open_device(url, token, device_id, tools=5)
    await asyncio.sleep(0.2)
    counted = _ListCounter(ws)
    note = json.dumps(
        {"type": "mcp", "payload": {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}}
    )

    async def step(_n: int) -> None:
        await ws.send(note)

    report = await _run("tools/list_changed storm", ws, duration_s, step, helper)
    report.detail["tools_list_requests"] = counted.count
    return report


class _ListCounter:
    """Counts the tools/list requests the bridge sends (wraps the handshake answerer's reads)."""

    def __init__(self, ws: ClientConnection) -> None:
        self.count = 0
        original = ws.recv

        async def recv(*args: Any, **kwargs: Any) -> Any:
            frame = await original(*args, **kwargs)
            if isinstance(frame, str) and '"tools/list"' in frame:
                self.count += 1
            return frame

        ws.recv = recv  # type: ignore[method-assign]


async def tool_flood(url: str, token: str, device_id: str, duration_s: float) -> AttackReport:
    """63 tools/list pages of nearly 64 KiB each: about 66,000 tools."""
    ws = await connect(url, additional_headers=headers(token, device_id), compression=None)
    await ws.send(json.dumps(HELLO))
    await ws.recv()
    tool = {"name": "", "description": "d" * 700, "inputSchema": {"type": "object"}}
    per_page = BIG // (len(json.dumps(tool)) + 20)
    pages = 0
    started = time.monotonic()
    with contextlib.suppress(ConnectionClosed, TimeoutError):
        async with asyncio.timeout(duration_s):
            async for frame in ws:
                payload = json.loads(frame).get("payload") or {}
                method, request_id = payload.get("method"), payload.get("id")
                if method == "initialize":
                    result: Any = {"protocolVersion": "2024-11-05", "serverInfo": {"name": "evil"}}
                elif method == "tools/list":
                    base = pages * per_page
                    declared = [{**tool, "name": f"evil.t{base + i}"} for i in range(per_page)]
                    pages += 1
                    result = {"tools": declared}
                    if pages < 63:
                        result["nextCursor"] = f"evil.t{base + per_page}"
                else:
                    continue
                reply = {"jsonrpc": "2.0", "id": request_id, "result": result}
                await ws.send(json.dumps({"type": "mcp", "payload": reply}))
    report = AttackReport("tool flood: 63 pages of ~64 KiB", sent=pages)
    report.seconds = time.monotonic() - started
    report.detail["tools_declared"] = pages * per_page
    report.close_code = ws.close_code
    if report.close_code is None:
        await ws.close()
    return report


# ---- disk (log lines) ----------------------------------------------------------------------------


async def log_bomb(url: str, token: str, device_id: str, duration_s: float) -> AttackReport:
    """60 KB listen texts and abort reasons, and junk of unknown types, at line rate."""
    ws, helper = await open_device(url, token, device_id)
    await asyncio.sleep(0.2)
    frames = [
        json.dumps({"type": "listen", "state": "detect", "text": "t" * BIG}),
        json.dumps({"type": "abort", "reason": "r" * BIG}),
        json.dumps({"type": "teleport", "junk": "j" * 100}),
        "not json at all",
    ]

    async def step(n: int) -> None:
        await ws.send(frames[n % len(frames)])

    return await _run("log bomb: 60 KB listen/abort, unknown types", ws, duration_s, step, helper)


async def nesting_bomb(url: str, token: str, device_id: str, duration_s: float) -> AttackReport:
    """Deeply nested JSON (`[` × 30,000), over and over."""
    ws, helper = await open_device(url, token, device_id)
    await asyncio.sleep(0.2)
    bomb = "[" * 30_000
    mcp_bomb = '{"type":"mcp","payload":' + "[" * 20_000

    async def step(n: int) -> None:
        await ws.send(bomb if n % 2 == 0 else mcp_bomb)

    return await _run("nesting bomb: [ × 30,000", ws, duration_s, step, helper)


# ---- fairness ------------------------------------------------------------------------------------


async def binary_flood(url: str, token: str, device_id: str, duration_s: float) -> AttackReport:
    """60 KB binary frames at loopback speed (protocol version 1: each one is audio)."""
    return await _binary_flood(url, token, device_id, duration_s, 1, b"\xf8" * BIG)


async def binary_flood_v2(url: str, token: str, device_id: str, duration_s: float) -> AttackReport:
    """60 KB binary frames that never decode (version 2 header, wrong payload size)."""
    header = struct.pack(">HHIII", 2, 0, 0, 0, 0xFFFFFFFF)
    return await _binary_flood(url, token, device_id, duration_s, 2, header + b"\xf8" * BIG)


async def binary_flood_v3(url: str, token: str, device_id: str, duration_s: float) -> AttackReport:
    """60 KB binary frames that never decode (version 3 header, wrong payload size)."""
    header = struct.pack(">BBH", 0, 0, 0xFFFF)
    return await _binary_flood(url, token, device_id, duration_s, 3, header + b"\xf8" * BIG)


async def _binary_flood(
    url: str, token: str, device_id: str, duration_s: float, version: int, frame: bytes
) -> AttackReport:
    ws, helper = await open_device(url, token, device_id, version=version)
    await asyncio.sleep(0.2)

    async def step(_n: int) -> None:
        await ws.send(frame)

    name = f"binary flood: {len(frame) // 1000} KB frames, version {version}"
    return await _run(name, ws, duration_s, step, helper)


async def oversize_frame(url: str, token: str, device_id: str, duration_s: float) -> AttackReport:
    """One text frame over the 64 KiB limit."""
    ws, helper = await open_device(url, token, device_id)
    await asyncio.sleep(0.2)

    async def step(_n: int) -> None:
        await ws.send(json.dumps({"type": "listen", "state": "detect", "text": "x" * 70_000}))
        await ws.wait_closed()

    return await _run("oversize frame (70 KB)", ws, duration_s, step, helper)


# ---- descriptors and handshakes ------------------------------------------------------------------


async def idle_sockets(url: str, count: int, duration_s: float) -> AttackReport:
    """`count` TCP connections that never send a byte (they hold descriptors and handshakes)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    opened: list[socket.socket] = []
    report = AttackReport(f"{count} idle sockets (no handshake)")
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, (host, port))
        except OSError:
            sock.close()
            report.detail["connect_errors"] = report.detail.get("connect_errors", 0) + 1
            continue
        opened.append(sock)
    report.sent = len(opened)
    await asyncio.sleep(max(0.0, duration_s - (time.monotonic() - started)))
    report.detail["closed_by_bridge"] = close_counting_peer_closes(opened)
    report.seconds = time.monotonic() - started
    return report


def close_counting_peer_closes(sockets: list[socket.socket]) -> int:
    """Close idle non-blocking sockets; how many the other side had already closed."""
    closed = 0
    for sock in sockets:
        try:
            if sock.recv(1) == b"":
                closed += 1
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        sock.close()
    return closed


async def same_id_storm(url: str, token: str, device_id: str, count: int) -> AttackReport:
    """`count` connections with one Device-Id, all at once, each saying hello."""
    report = AttackReport(f"{count} parallel connections with one Device-Id")
    started = time.monotonic()

    async def one() -> int | None:
        try:
            ws = await connect(url, additional_headers=headers(token, device_id), compression=None)
        except Exception:  # refused, dropped at accept, or cut mid-handshake
            return -1
        try:
            await ws.send(json.dumps(HELLO))
            await ws.recv()
        except ConnectionClosed:
            return ws.close_code
        await ws.close()
        return ws.close_code

    codes = await asyncio.gather(*(one() for _ in range(count)))
    report.sent = count
    report.seconds = time.monotonic() - started
    report.detail["close_codes"] = sorted({code for code in codes if code is not None})
    return report


async def drop_after_hello(url: str, token: str, device_prefix: str, count: int) -> AttackReport:
    """`count` devices that drop TCP right after their hello, in the middle of the handshake."""
    report = AttackReport(f"{count} devices dropping TCP right after hello")
    started = time.monotonic()

    async def one(index: int) -> None:
        device_id = f"{device_prefix}:{index // 256:02x}:{index % 256:02x}"
        ws = await connect(url, additional_headers=headers(token, device_id), compression=None)
        await ws.send(json.dumps(HELLO))
        ws.transport.abort()

    await asyncio.gather(*(one(i) for i in range(count)), return_exceptions=True)
    report.sent = count
    report.seconds = time.monotonic() - started
    return report


ATTACKS: dict[str, Callable[[str, str, str, float], Awaitable[AttackReport]]] = {
    "ping_flood": ping_flood,
    "small_ping_flood": small_ping_flood,
    "list_changed_storm": list_changed_storm,
    "tool_flood": tool_flood,
    "log_bomb": log_bomb,
    "nesting_bomb": nesting_bomb,
    "binary_flood": binary_flood,
    "binary_flood_v2": binary_flood_v2,
    "binary_flood_v3": binary_flood_v3,
    "oversize_frame": oversize_frame,
}


RETRY_S = 0.5  # how soon a cut-off attacker tries again


async def persistently(
    attack: Callable[[str, str, str, float], Awaitable[AttackReport]],
    url: str,
    token: str,
    device_id: str,
    duration_s: float,
) -> AttackReport:
    """An attacker that does not give up: cut off, it reconnects (every `RETRY_S` while its
    handshakes are refused) and attacks again until `duration_s` is spent. The report adds up
    its links; `close_code` is the first cut-off's; `detail` counts links and refusals."""
    started = time.monotonic()
    total: AttackReport | None = None
    links = refused = 0
    while (left := duration_s - (time.monotonic() - started)) > 0.05:
        try:
            report = await attack(url, token, device_id, left)
        except (InvalidStatus, ConnectionClosed, OSError):
            refused += 1  # held off, or closed before the attack began
            await asyncio.sleep(RETRY_S)
            continue
        links += 1
        if total is None:
            total = report
        else:
            total.sent += report.sent
            total.close_code = total.close_code or report.close_code
        if not report.cut_off:
            break  # it held its link for the whole time
    if total is None:
        total = AttackReport(f"{getattr(attack, '__name__', 'attack')} (never connected)")
    total.seconds = time.monotonic() - started
    total.detail.update(links=links, refused_handshakes=refused)
    return total


async def run_attack(
    name: str, url: str, token: str, device_id: str, amount: float
) -> AttackReport:
    """One attack by name; `amount` is a duration in seconds, or a count for the storms."""
    if name in ATTACKS:
        return await persistently(ATTACKS[name], url, token, device_id, amount)
    if name == "idle_sockets":
        return await idle_sockets(url, int(amount), 3.0)
    if name == "same_id_storm":
        return await same_id_storm(url, token, device_id, int(amount))
    if name == "drop_after_hello":
        return await drop_after_hello(url, token, device_id.rsplit(":", 2)[0], int(amount))
    raise ValueError(f"unknown attack {name!r}")


def main() -> None:
    """`python -m testkit.hostile ATTACK URL TOKEN DEVICE_ID AMOUNT`: one attack in its own
    process (so its bursts never slow the measuring process), its report as one JSON line."""
    import sys
    from dataclasses import asdict

    name, url, token, device_id, amount = sys.argv[1:6]
    report = asyncio.run(run_attack(name, url, token, device_id, float(amount)))
    print(json.dumps(asdict(report)), flush=True)


if __name__ == "__main__":
    main()
