"""The device HTTP listener (OTA, activation, vision) against one hostile address (issue #32,
items 2, 4 and 7), over real loopback sockets to a real bridge.

Other addresses are other loopback addresses (Linux routes all of 127.0.0.0/8 to `lo`); the
tests that need them set `rate_limit_exempt = []` so loopback counts as any other network.
"""

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from backend.provisioning import http as provisioning_http
from backend.provisioning import service as provisioning_service
from backend.server import Bridge
from backend.vision import service as vision_service
from backend.vision.service import VISION_PATH
from simulator.stock_ota import stock_headers, system_info
from testkit.camera_upload import (
    HttpAnswer,
    chunked,
    fake_jpeg,
    read_answer,
    stock_head,
    stock_parts,
)
from testkit.stock_device import CLIENT_ID
from tests.helpers import can_bind, eventually

ATTACKER = "127.0.0.2"
DEVICE_ADDRESS = "127.0.0.3"
MAC = "a4:cf:12:34:56:78"
VICTIM = "a4:cf:12:34:56:79"

several_addresses = pytest.mark.skipif(
    not (can_bind(ATTACKER) and can_bind(DEVICE_ADDRESS)),
    reason="needs several loopback addresses (Linux routes 127.0.0.0/8 to lo)",
)


class Lines:
    """Stands in for a module's structlog logger: records every line asked for."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def bind(self, **_fields: Any) -> "Lines":
        return self

    def __getattr__(self, level: str) -> Callable[..., None]:
        def line(event: str, **fields: Any) -> None:
            self.lines.append((level, event, fields))

        return line


def vision_url(bridge: Bridge) -> str:
    return f"http://127.0.0.1:{bridge.provisioning.http_port}{VISION_PATH}"


async def upload_from(
    bridge: Bridge, source: str | None, *, device_id: str = MAC, token: str | None = None
) -> HttpAnswer:
    """A stock upload (chunked multipart) from `source`, and its answer."""
    url = vision_url(bridge)
    token = bridge.provisioning.vision.token_for(device_id) if token is None else token
    head = stock_head(url, device_id=device_id, client_id=CLIENT_ID, token=token)
    bind: dict[str, Any] = {} if source is None else {"local_addr": (source, 0)}
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", bridge.provisioning.http_port, **bind
    )
    try:
        writer.write(head + chunked(stock_parts("what is it?", fake_jpeg(5_000))))
        return await asyncio.wait_for(read_answer(reader), 10)
    finally:
        writer.close()


# ---- item 2: one address cannot deny the listener to others ----------------------------------


@several_addresses
async def test_one_address_holding_idle_sockets_does_not_stop_ota_and_vision_of_another(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge: Bridge = await bridge_factory(
        device_auth="shared",
        rate_limit_exempt=[],
        device_http_max_connections=40,  # uvicorn's 503 past 40, dropped at accept past 80
        max_pending_handshakes_per_address=16,
        # A fast rate, so that the share (not the rate) is what stops the idle sockets.
        rate_limits={"connection_ip": {"per_s": 1000, "burst": 1000}},
    )
    port = bridge.provisioning.http_port
    guard = bridge.provisioning.connections
    held: list[socket.socket] = []
    try:
        for _ in range(120):  # 3 × the listener's cap, from one address
            sock = socket.socket()
            sock.bind((ATTACKER, 0))
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            held.append(sock)
        await eventually(lambda: guard.refused >= 120 - 16)
        assert sum(1 for a in guard.pending.values() if a == ATTACKER) == 16
        transport = httpx.AsyncHTTPTransport(local_address=DEVICE_ADDRESS)
        async with httpx.AsyncClient(transport=transport, timeout=10) as http:
            ota = [  # 20 devices behind one address (a device's own budget is 10 at once)
                await http.post(
                    bridge.provisioning.ota_url,
                    json=system_info(mac=f"a4:cf:12:34:57:{i:02x}", client_id=CLIENT_ID),
                    headers=stock_headers(mac=f"a4:cf:12:34:57:{i:02x}", client_id=CLIENT_ID),
                )
                for i in range(20)
            ]
        assert [r.status_code for r in ota] == [200] * 20
        uploads = [await upload_from(bridge, DEVICE_ADDRESS) for _ in range(2)]
        assert [u.status for u in uploads] == [200, 200]  # answered (no model: success false)
    finally:
        for sock in held:
            sock.close()
    await eventually(lambda: ATTACKER not in guard.pending.values())


async def test_a_declared_body_that_never_arrives_is_answered_408_and_closed(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge: Bridge = await bridge_factory(device_auth="shared", device_http_body_timeout_s=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", bridge.provisioning.http_port)
    headers = stock_headers(mac=MAC, client_id=CLIENT_ID)
    head = "POST /xiaozhi/ota/ HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    began = time.monotonic()
    writer.write(head.encode() + b'{"ver')  # 5 of the 500 bytes, then nothing
    try:
        answer = await asyncio.wait_for(read_answer(reader), 10)
        assert answer.status == 408 and answer.headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the bridge
        assert time.monotonic() - began < 5
    finally:
        writer.close()
    # Half-closed by the bridge (the rest of the body would be dropped); gone once we close.
    await eventually(lambda: not bridge.provisioning.connections.pending)


# ---- item 4: unauthenticated uploads cost a few lines and no row as a device ------------------


async def test_a_thousand_unauthenticated_uploads_write_few_log_lines(
    bridge_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = Lines()
    for module in (vision_service, provisioning_service, provisioning_http):
        monkeypatch.setattr(module, "log", lines)
    bridge: Bridge = await bridge_factory(device_auth="shared")  # loopback exempt: no 429
    url = vision_url(bridge)
    head = stock_head(url, device_id=VICTIM, client_id=CLIENT_ID, token="vtk_wrong")
    request = head + chunked([b"x"])
    port = bridge.provisioning.http_port

    async def one() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            return (await asyncio.wait_for(read_answer(reader), 10)).status
        finally:
            writer.close()

    statuses: list[int] = []
    for _ in range(100):
        statuses += await asyncio.gather(*(one() for _ in range(10)))
    assert statuses == [401] * 1000
    assert len(lines.lines) < 100, lines.lines[:20]
    refused = [fields for _level, event, fields in lines.lines if event == "vision upload refused"]
    assert refused and refused[0]["claimed_device_id"] == VICTIM


@several_addresses
async def test_an_address_whose_uploads_keep_being_refused_is_dropped_at_accept(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge: Bridge = await bridge_factory(device_auth="shared", rate_limit_exempt=[])
    guard = bridge.provisioning.connections
    statuses: list[int | str] = []
    for _ in range(30):
        try:
            answer = await upload_from(bridge, ATTACKER, device_id=VICTIM, token="vtk_wrong")
            statuses.append(answer.status)
        except (ConnectionError, asyncio.IncompleteReadError):
            statuses.append("dropped")
    assert statuses[:20] == [401] * 20 and "dropped" in statuses  # the penalty box
    assert guard.refused > 0
    assert (await upload_from(bridge, DEVICE_ADDRESS, device_id=MAC)).status == 200


async def test_an_upload_naming_another_device_with_bad_credentials_writes_no_row_as_it(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge: Bridge = await bridge_factory(device_auth="shared")
    stranger_token = bridge.provisioning.vision.token_for(MAC)  # a real token, not the victim's
    for token in ("vtk_wrong", stranger_token, ""):
        for _ in range(10):
            assert (await upload_from(bridge, None, device_id=VICTIM, token=token)).status == 401
    assert await bridge.audit.entries(device_id=VICTIM) == []
    assert await bridge.audit.entries(actor=f"device:{VICTIM}") == []
    rows = await bridge.audit.entries(tool="vision.explain", limit=1000)
    assert rows and len(rows) <= 5  # the strangers' rows of one address: 5, then 1 a minute
    assert {row.actor for row in rows} == {"unauthenticated:127.0.0.1"}
    assert all(row.device_id == "unauthenticated:127.0.0.1" for row in rows)
    assert all(VICTIM in (row.error or "") and row.outcome == "unauthorized" for row in rows)
    # The device's own upload is its row.
    assert (await upload_from(bridge, None, device_id=VICTIM)).status == 200
    (own,) = await bridge.audit.entries(device_id=VICTIM)
    assert own.actor == f"device:{VICTIM}" and own.outcome == "no_model"


async def test_audit_retention_deletes_old_rows_and_caps_the_table(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge: Bridge = await bridge_factory(audit_retention_days=30, audit_max_rows=5)
    audit = bridge.audit
    assert audit.retention_s == 30 * 86400 and audit.max_rows == 5

    def row(device_id: str) -> None:
        audit.record_upload(device_id, tool="vision.explain", question="q", size=1,
                            outcome="ok", error=None, duration_ms=1.0)  # fmt: skip

    for i in range(3):
        row(f"old-{i}")
    await audit.flush()
    old = time.time() - 31 * 86400
    await bridge.database.execute("UPDATE audit_log SET at = ?", (old,))
    for i in range(7):
        row(f"new-{i}")
    await audit.flush()
    assert await audit.prune() == 3 + 2  # 3 past 30 days, then the 2 oldest past 5 rows
    left = [entry.device_id for entry in await audit.entries(limit=100)]
    assert left == [f"new-{i}" for i in range(6, 1, -1)]
    assert await audit.prune() == 0


# ---- item 7: an over-size body is answered, not reset ------------------------------------------


def _send_then_read(port: int, request_head: bytes, body: bytes) -> bytes:
    """A blocking client: the whole request (head and body) with sendall, then read to EOF.
    A reset on either side raises ConnectionResetError (or BrokenPipeError)."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(request_head + body)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


@pytest.mark.parametrize("encoding", ["content-length", "chunked"])
async def test_an_oversized_upload_is_answered_413_without_a_reset(
    bridge_factory: Callable[..., Any], encoding: str
) -> None:
    bridge: Bridge = await bridge_factory(device_auth="shared", vision_max_bytes=64 * 1024)
    port = bridge.provisioning.http_port
    token = bridge.provisioning.vision.token_for(MAC)
    parts = stock_parts("what is it?", fake_jpeg(3 * 1024 * 1024))
    if encoding == "chunked":
        head = stock_head(vision_url(bridge), device_id=MAC, client_id=CLIENT_ID, token=token)
        body = chunked(parts)
    else:
        body = b"".join(parts)
        head = stock_head(
            vision_url(bridge),
            device_id=MAC,
            client_id=CLIENT_ID,
            token=token,
            extra={"Content-Length": str(len(body))},
        ).replace(b"Transfer-Encoding: chunked\r\n", b"")
    for _ in range(3):
        received = await asyncio.to_thread(_send_then_read, port, head, body)
        assert received.startswith(b"HTTP/1.1 413"), received[:200]
        assert b"connection: close" in received.lower()
        assert json.loads(received.split(b"\r\n\r\n", 1)[1])["success"] is False
    await eventually(lambda: not bridge.provisioning.connections.pending)


async def test_an_oversized_ota_body_is_answered_413_without_a_reset(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge: Bridge = await bridge_factory(device_auth="shared")
    headers = stock_headers(mac=MAC, client_id=CLIENT_ID)
    body = b"{" + b" " * (2 * 1024 * 1024) + b"}"
    head = f"POST /xiaozhi/ota/ HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    received = await asyncio.to_thread(
        _send_then_read, bridge.provisioning.http_port, head.encode(), body
    )
    assert received.startswith(b"HTTP/1.1 413"), received[:200]
