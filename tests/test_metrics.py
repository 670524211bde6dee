"""Prometheus metrics (docs/metrics.md): `GET /metrics` read over real HTTP and parsed with the
official parser, its scope and its listener, and each family moving when its event happens on a
real bridge (real WebSockets, the device HTTP listener, the database writer).

Counters only grow and the registry is the process's own, so every check compares a scrape taken
before the event with one taken after it.
"""

import asyncio
import json
import re
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import InvalidStatus

from backend import metrics
from backend.auth import Tokens
from backend.errors import ListenError
from backend.server import Bridge
from simulator import stock_ota
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from testkit.stock_device import CLIENT_ID, WireDevice
from tests.helpers import can_bind, create_key, eventually, wait_state

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAC = "a4:cf:12:34:56:78"


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(url, headers=ADMIN if headers is None else headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def families(samples: Iterable[tuple[str, Any]]) -> set[str]:
    return {name for name, _labels in samples}


def metrics_url(bridge: Bridge) -> str:
    return f"{bridge.api_url}/metrics"


# ---- the route, its scope and its listener ------------------------------------------------------


async def test_metrics_need_a_key_with_metrics_read(bridge: Bridge) -> None:
    url = metrics_url(bridge)
    chat_key = await create_key(bridge, "chat:use")
    scraper = await create_key(bridge, "metrics:read")
    async with httpx.AsyncClient(timeout=10) as client:
        missing = await client.get(url)
        wrong = await client.get(url, headers={"Authorization": "Bearer esk_nope"})
        other_scope = await client.get(url, headers={"Authorization": f"Bearer {chat_key}"})
        allowed = await client.get(url, headers={"Authorization": f"Bearer {scraper}"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "unauthorized"
    assert wrong.status_code == 401
    assert other_scope.status_code == 403
    assert other_scope.json()["error"]["message"] == "this key lacks the scope metrics:read"
    assert allowed.status_code == 200
    names = families(parse(allowed.text))
    # Every family is listed from the first scrape on (closed label sets, pre-bound).
    for family in (
        "bridge_devices",
        "bridge_handshakes_refused_total",
        "bridge_device_messages_total",
        "bridge_mcp_calls_total",
        "bridge_mcp_call_seconds_bucket",
        "bridge_chat_turns_total",
        "bridge_chat_stage_seconds_count",
        "bridge_voice_stage_seconds_count",
        "bridge_ota_checks_total",
        "bridge_db_flush_seconds_count",
        "bridge_event_loop_lag_seconds_count",
    ):
        assert family in names, family
    assert not any(name.endswith("_created") for name in names)


async def test_admin_token_reads_metrics_and_the_scope_is_listed(bridge: Bridge) -> None:
    assert await scrape(metrics_url(bridge))  # the admin token has every scope
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=ADMIN, timeout=10) as client:
        created = await client.post("/api/keys", json={"name": "s", "scopes": ["metrics:read"]})
        refused = await client.post("/api/keys", json={"name": "s", "scopes": ["metrics"]})
    assert created.status_code == 201, created.text
    assert refused.status_code == 422 and "metrics:read" in refused.text


async def test_dedicated_listener_is_on_loopback_behind_the_same_gate(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(metrics_port=0)
    assert bridge.metrics_listener is not None
    url = bridge.metrics_listener.url
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    chat_key = await create_key(bridge, "chat:use")
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.get(url)).status_code == 401
        other = await client.get(url, headers={"Authorization": f"Bearer {chat_key}"})
        assert other.status_code == 403
        assert (await client.get(url, headers=ADMIN)).status_code == 200
        # Nothing else is served there, not even with the admin token.
        elsewhere = url.replace("/metrics", "/api/devices")
        assert (await client.get(elsewhere, headers=ADMIN)).status_code == 404
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    if can_bind("127.0.0.2"):  # another address of this host: nothing listens there
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.settimeout(2)
            probe.connect(("127.0.0.2", port))


async def test_metrics_auth_off_opens_the_dedicated_listener_only(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(metrics_port=0, metrics_auth=False)
    assert bridge.metrics_listener is not None
    async with httpx.AsyncClient(timeout=10) as client:
        opened = await client.get(bridge.metrics_listener.url)
        admin_listener = await client.get(metrics_url(bridge))
    assert opened.status_code == 200 and "bridge_devices" in opened.text
    assert admin_listener.status_code == 401


async def test_metrics_disabled_serves_nothing_and_records_nothing(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(metrics_enabled=False, metrics_port=0)
    try:
        assert bridge.metrics_listener is None
        before = parse(metrics.generate_text())
        device = WireDevice(bridge.ws_url, "wrong token", MAC)
        with pytest.raises(InvalidStatus):
            await device.connect()
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.get(metrics_url(bridge), headers=ADMIN)).status_code == 404
        after = parse(metrics.generate_text())
        labels = {"transport": "websocket", "reason": "credential"}
        assert value(after, "bridge_handshakes_refused_total", **labels) == value(
            before, "bridge_handshakes_refused_total", **labels
        )
    finally:
        await bridge.stop()
        metrics.set_enabled(True)


# ---- families moving with their events ----------------------------------------------------------


async def test_device_gauge_traffic_and_tool_calls(bridge: Bridge, wire_devices, api) -> None:
    url = metrics_url(bridge)
    before = await scrape(url)
    ready = {"state": "ready", "transport": "websocket"}
    assert value(before, "bridge_devices", **ready) == 0
    device = wire_devices(MAC)
    await device.connect()
    await wait_state(bridge, MAC)
    connected = await scrape(url)
    assert value(connected, "bridge_devices", **ready) == 1
    text_in = {"transport": "websocket", "direction": "in", "kind": "text"}
    text_out = {"transport": "websocket", "direction": "out", "kind": "text"}
    for name in ("bridge_device_messages_total", "bridge_device_bytes_total"):
        assert value(connected, name, **text_in) > value(before, name, **text_in)
        assert value(connected, name, **text_out) > value(before, name, **text_out)
    # hello + initialize reply + tools/list reply, at least; their sizes at least their count
    moved = value(connected, "bridge_device_messages_total", **text_in) - value(
        before, "bridge_device_messages_total", **text_in
    )
    assert moved >= 3

    ok = await api.post(f"/api/devices/{MAC}/tools/call", json={"name": "self.get_device_status"})
    assert ok.status_code == 200
    unknown = await api.post(f"/api/devices/{MAC}/tools/call", json={"name": "self.nope"})
    assert unknown.status_code == 404
    called = await scrape(url)
    for outcome, count in (("ok", 1), ("refused", 1), ("timeout", 0)):
        moved = value(called, "bridge_mcp_calls_total", outcome=outcome) - value(
            connected, "bridge_mcp_calls_total", outcome=outcome
        )
        assert moved == count, outcome
    # The latency of the call that reached the device is observed; a refused one is not.
    assert (
        value(called, "bridge_mcp_call_seconds_count", outcome="ok")
        == value(connected, "bridge_mcp_call_seconds_count", outcome="ok") + 1
    )
    assert value(called, "bridge_mcp_call_seconds_count", outcome="refused") == value(
        connected, "bridge_mcp_call_seconds_count", outcome="refused"
    )

    await device.close()
    await eventually(lambda: bridge.registry.get(MAC) is None)
    gone = await scrape(url)
    assert value(gone, "bridge_devices", **ready) == 0
    assert value(gone, "bridge_devices_known") >= 1


async def test_tool_error_and_timeout_outcomes(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(call_timeout_s=0.3)
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, MAC)

    async def hang(_device: WireDevice, _payload: dict[str, Any]) -> None:
        return None  # never answers

    try:
        await device.connect()
        live = await wait_state(bridge, MAC)
        before = await scrape(metrics_url(bridge))
        device.handlers["tools/call"] = hang
        with pytest.raises(Exception, match="timed out"):
            await live.call_tool("self.get_device_status")
        after = await scrape(metrics_url(bridge))
    finally:
        await device.close()
    assert (
        value(after, "bridge_mcp_calls_total", outcome="timeout")
        == value(before, "bridge_mcp_calls_total", outcome="timeout") + 1
    )
    assert (
        value(after, "bridge_mcp_call_seconds_sum", outcome="timeout")
        - value(before, "bridge_mcp_call_seconds_sum", outcome="timeout")
        >= 0.3
    )


async def test_list_changed_relist_is_counted(bridge: Bridge, wire_devices) -> None:
    device = wire_devices(MAC)
    await device.connect()
    live = await wait_state(bridge, MAC)
    before = await scrape(metrics_url(bridge))
    device.tools = [*device.tools, {"name": "self.new", "inputSchema": {"type": "object"}}]
    await device.reply({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    await eventually(lambda: "self.new" in live.tools.by_name)
    after = await scrape(metrics_url(bridge))
    assert (
        value(after, "bridge_mcp_tool_relists_total", outcome="ok")
        == value(before, "bridge_mcp_tool_relists_total", outcome="ok") + 1
    )


async def test_refused_handshakes_by_reason(bridge: Bridge) -> None:
    url = metrics_url(bridge)
    before = await scrape(url)
    for device in (
        WireDevice(bridge.ws_url, "wrong", MAC),  # credential
        WireDevice(bridge.ws_url, DEVICE_TOKEN, "bad id!"),  # malformed
        WireDevice(bridge.ws_url.replace("/xiaozhi/v1/", "/elsewhere/"), DEVICE_TOKEN, MAC),
    ):
        with pytest.raises(InvalidStatus):
            await device.connect()
    after = await scrape(url)
    for reason in ("credential", "malformed", "not_found"):
        labels = {"transport": "websocket", "reason": reason}
        moved = value(after, "bridge_handshakes_refused_total", **labels) - value(
            before, "bridge_handshakes_refused_total", **labels
        )
        assert moved == 1, reason
    labels = {"transport": "websocket", "reason": "device_rate"}
    assert value(after, "bridge_handshakes_refused_total", **labels) == value(
        before, "bridge_handshakes_refused_total", **labels
    )


async def test_dropped_frames_and_cut_offs(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(max_message_bytes=1024)
    url = metrics_url(bridge)
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, MAC)
    await device.connect()
    await wait_state(bridge, MAC)
    before = await scrape(url)
    await device.send("not json at all")
    await device.send(b"\x01")  # protocol v1: a raw Opus packet, counted as audio in
    await device.round_trip()
    mid = await scrape(url)
    labels = {"transport": "websocket", "reason": "malformed"}
    assert (
        value(mid, "bridge_device_frames_dropped_total", **labels)
        == value(before, "bridge_device_frames_dropped_total", **labels) + 1
    )
    audio_in = {"transport": "websocket", "direction": "in", "kind": "audio"}
    assert (
        value(mid, "bridge_device_messages_total", **audio_in)
        == value(before, "bridge_device_messages_total", **audio_in) + 1
    )
    assert device.ws is not None
    await device.send("x" * 4096)  # over max_message_bytes: websockets closes with 1009
    await asyncio.wait_for(device.ws.wait_closed(), 5)
    assert device.ws.close_code == 1009
    cut = {"transport": "websocket", "reason": "message_too_big"}
    await eventually(lambda: bridge.registry.get(MAC) is None)
    after = await scrape(url)
    assert (
        value(after, "bridge_device_cutoffs_total", **cut)
        == value(before, "bridge_device_cutoffs_total", **cut) + 1
    )
    await device.close()


async def test_inbound_flood_is_a_cut_off(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(max_inbound_messages_per_s=5.0)
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, MAC)
    await device.connect()
    await wait_state(bridge, MAC)
    before = await scrape(metrics_url(bridge))
    assert device.ws is not None
    with pytest.raises(Exception):  # noqa: B017 - closed while flooding: any send error
        for _ in range(2000):
            await device.send(json.dumps({"type": "listen", "state": "detect", "text": "hi"}))
            await asyncio.sleep(0)
    await asyncio.wait_for(device.ws.wait_closed(), 5)
    after = await scrape(metrics_url(bridge))
    cut = {"transport": "websocket", "reason": "inbound_rate"}
    assert (
        value(after, "bridge_device_cutoffs_total", **cut)
        == value(before, "bridge_device_cutoffs_total", **cut) + 1
    )
    await device.close()


async def test_ota_checks_activation_and_approval(bridge_factory) -> None:
    bridge: Bridge = await bridge_factory(device_auth="device")
    url = metrics_url(bridge)
    ota = bridge.provisioning.ota_url
    before = await scrape(url)
    headers = stock_ota.stock_headers(MAC, CLIENT_ID)
    body = stock_ota.system_info(MAC, CLIENT_ID)
    async with httpx.AsyncClient(timeout=10) as http:
        first = await http.post(ota, headers=headers, json=body)
        code = first.json()["activation"]["code"]
        polled = await http.post(f"{ota}activate", headers=headers, json={})
        bad = await http.post(ota, headers={**headers, "Device-Id": "bad id!"}, json=body)
        async with httpx.AsyncClient(base_url=bridge.api_url, headers=ADMIN) as admin:
            approved = await admin.post("/api/provisioning/approve", json={"target": code})
        second = await http.post(ota, headers=headers, json=body)
    assert (first.status_code, polled.status_code, bad.status_code) == (200, 202, 400)
    assert approved.status_code == 200 and "websocket" in second.json()
    after = await scrape(url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("bridge_ota_checks_total", outcome="activation") == 1
    assert moved("bridge_ota_checks_total", outcome="answered") == 1
    assert moved("bridge_ota_checks_total", outcome="refused") == 1
    assert moved("bridge_activations_total", outcome="pending") == 1
    assert moved("bridge_activation_approvals_total", by="operator") == 1


async def test_database_flush_and_loop_lag_are_observed(bridge: Bridge, wire_devices) -> None:
    url = metrics_url(bridge)
    before = await scrape(url)
    device = wire_devices(MAC)
    await device.connect()
    await wait_state(bridge, MAC)
    flushed = {"writer": "device-catalog"}

    async def moved() -> bool:
        now = await scrape(url)
        return value(now, "bridge_db_flush_seconds_count", **flushed) > value(
            before, "bridge_db_flush_seconds_count", **flushed
        ) and value(now, "bridge_event_loop_lag_seconds_count") > value(
            before, "bridge_event_loop_lag_seconds_count"
        )

    async with asyncio.timeout(10):
        while not await moved():  # noqa: ASYNC110 - polled over HTTP, no event to wait on
            await asyncio.sleep(0.1)
    now = await scrape(url)
    assert ("bridge_db_write_queue_depth", frozenset({("writer", "device-catalog")})) in now
    assert value(now, "bridge_event_loop_lag_last_seconds") >= 0


# ---- the recorders themselves -------------------------------------------------------------------


def test_unknown_label_values_are_counted_as_other() -> None:
    before = parse(metrics.generate_text())
    metrics.record_chat_turn("something new")
    metrics.record_handshake_refused("carrier-pigeon", "weather")
    metrics.record_mcp_call("strange", 0.01)
    after = parse(metrics.generate_text())
    assert (
        value(after, "bridge_chat_turns_total", path="other")
        == value(before, "bridge_chat_turns_total", path="other") + 1
    )
    labels = {"transport": "other", "reason": "other"}
    assert (
        value(after, "bridge_handshakes_refused_total", **labels)
        == value(before, "bridge_handshakes_refused_total", **labels) + 1
    )
    assert (
        value(after, "bridge_mcp_calls_total", outcome="other")
        == value(before, "bridge_mcp_calls_total", outcome="other") + 1
    )
    # No new series: the label sets stay closed.
    assert set(after) - set(before) == set()


def test_chat_recorders_and_voice_stages() -> None:
    before = parse(metrics.generate_text())
    metrics.record_chat_turn("offline")
    metrics.record_chat_stage("search", 0.2)
    metrics.record_voice_turn(
        {
            "end_of_speech_ms": 0.0,
            "recognized_ms": 300.0,
            "first_token_ms": 1300.0,
            "first_audio_ms": 1400.0,
            "first_frame_sent_ms": 1450.0,
            "silence_wait_ms": 600.0,
        }
    )
    metrics.record_voice_turn({"end_of_speech_ms": 0.0})  # a turn that ended early: nothing
    after = parse(metrics.generate_text())

    def moved(name: str, **labels: str) -> float:
        return round(value(after, name, **labels) - value(before, name, **labels), 6)

    assert moved("bridge_chat_turns_total", path="offline") == 1
    assert moved("bridge_chat_stage_seconds_sum", stage="search") == 0.2
    expected = {"vad": 0.6, "asr": 0.3, "llm": 1.0, "tts": 0.1, "first_audio_out": 1.45}
    for stage, seconds in expected.items():
        assert moved("bridge_voice_stage_seconds_count", stage=stage) == 1, stage
        assert moved("bridge_voice_stage_seconds_sum", stage=stage) == seconds, stage


def test_disabled_recorders_are_no_ops() -> None:
    before = parse(metrics.generate_text())
    metrics.set_enabled(False)
    try:
        metrics.record_chat_turn("llm")
        metrics.link_metrics("websocket").text_in.add(10)
        metrics.record_mcp_call("ok", 0.001)
    finally:
        metrics.set_enabled(True)
    assert parse(metrics.generate_text()) == before


class _Instance:
    """A stand-in cluster instance (backend.metrics.ClusterMember)."""

    instance_id = "x"
    fenced = draining = False
    broker_connected = True
    renew_lag_s = 0.0
    devices_owned = 0
    counters: dict[str, int] = {}  # noqa: RUF012 - read only


def test_dashboard_and_docs_name_only_families_that_exist() -> None:
    """docs/grafana/bridge-dashboard.json and docs/metrics.md against the registry: a renamed
    family would leave an empty panel or a wrong table row."""
    repo = Path(__file__).resolve().parent.parent
    member = _Instance()  # the bridge_cluster_* families exist only with a cluster instance
    metrics.watch_cluster(member)
    try:
        exposed = {family.name for family in metrics.REGISTRY.collect()}
    finally:
        metrics.unwatch_cluster(member)
    dashboard = json.loads((repo / "docs/grafana/bridge-dashboard.json").read_text())
    queries = " ".join(
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    )
    suffixes = r"(_bucket|_sum|_count|_total)?\b"
    used = {re.sub(suffixes, "", name) for name in re.findall(r"\bbridge_[a-z_]+", queries)}
    assert used and used <= exposed, used - exposed
    assert used == exposed, exposed - used  # every family has a panel
    documented = re.findall(r"^\| `(bridge_[a-z_]+)`", (repo / "docs/metrics.md").read_text(), re.M)
    assert {re.sub(suffixes, "", name) for name in documented} <= exposed


async def test_a_taken_metrics_port_names_itself_and_the_bridge_stops_cleanly(
    tmp_path: Path,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        bridge = Bridge(
            make_settings(tmp_path / "data", metrics_port=port),
            Tokens(admin=ADMIN_TOKEN, device=DEVICE_TOKEN),
        )
        with pytest.raises(ListenError) as refused:
            await bridge.start()
    assert (refused.value.setting, refused.value.port) == ("metrics", port)
    assert "address already in use" in str(refused.value)
    assert bridge.metrics_listener is None or bridge.metrics_listener._socket is None
    await bridge.stop()  # a second stop after the failed start is harmless
