"""The talk page's server side: tickets (`POST /api/console/talk`) and the browser device
endpoint (`/console/device?ticket=`), driven from Python with a websockets client (no browser).

Every refusal the endpoint makes is exercised (unknown, reused, expired ticket, revoked key,
another site's Origin, a burst of bad tickets), its bounds (oversized messages, junk binary),
what the page learns beyond the stock protocol (the ticket's `voice`, the `tool_call` messages
of the device's own turns), and one full voice turn through it. backend/transports/browser.py.
"""

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from structlog.testing import capture_logs
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from backend.devices.state import EventKind
from backend.server import Bridge
from backend.transports.browser import DEVICE_PATH, TalkTickets, tool_call_text
from simulator.voice_client import VoiceDevice, _hello, speak_turn
from simulator.voice_links import WebSocketLink
from testkit.settings import ADMIN_TOKEN
from tests.helpers import ManualClock, create_key, eventually, wait_state
from tests.voice_helpers import spoken

TALK = "/api/console/talk"
STOCK_HELLO = _hello(1, "websocket", "pcm16", None)


def key_id_of(token: str) -> str:
    return token.split("_")[1]


async def ticket_for(bridge: Bridge, token: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=bridge.api_url, timeout=10) as client:
        response = await client.post(TALK, headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def device_url(bridge: Bridge, ticket: str | None) -> str:
    base = bridge.api_url.replace("http://", "ws://") + DEVICE_PATH
    return base if ticket is None else f"{base}?ticket={ticket}"


async def refused_status(url: str, **kwargs: Any) -> int:
    """The HTTP status the upgrade was answered with (it must not succeed)."""
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url, open_timeout=5, **kwargs):
            pass
    return refused.value.response.status_code


def talking_device(bridge: Bridge, ticket: str, audio_format: str = "pcm16") -> VoiceDevice:
    """The simulator's stock voice device, on the browser endpoint (its headers are ignored)."""
    link = WebSocketLink(device_url(bridge, ticket), None, "ignored", str(uuid.uuid4()), 1)
    hello = _hello(1, "websocket", audio_format, None)  # type: ignore[arg-type]
    return VoiceDevice(link, hello, audio_format=audio_format)  # type: ignore[arg-type]


async def hello(ws: ClientConnection) -> dict[str, Any]:
    """Send the stock hello, return the server's."""
    await ws.send(json.dumps(STOCK_HELLO))
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 5))
        if message.get("type") == "hello":
            return dict(message)


# ---- tickets -----------------------------------------------------------------------------------


async def test_a_ticket_needs_the_console_talk_scope(bridge: Bridge) -> None:
    talker = await create_key(bridge, "console:talk")
    chatter = await create_key(bridge, "chat:use", "devices:call")
    async with httpx.AsyncClient(base_url=bridge.api_url, timeout=10) as client:
        assert (await client.post(TALK)).status_code == 401
        bad = {"Authorization": "Bearer esk_0123456789ab_not-a-key"}
        assert (await client.post(TALK, headers=bad)).status_code == 401
        other = {"Authorization": f"Bearer {chatter}"}
        refused = await client.post(TALK, headers=other)
        assert refused.status_code == 403 and "console:talk" in refused.json()["error"]["message"]
        assert (await client.get(TALK, headers=other)).status_code == 405
    issued = await ticket_for(bridge, talker)
    assert issued["device_id"] == f"browser-{key_id_of(talker)}"
    assert issued["path"] == DEVICE_PATH and issued["expires_in_s"] == 30
    assert len(issued["ticket"]) >= 40
    # The tests' bridge has voice off: the page is told before it captures anything.
    assert issued["voice"]["available"] is False
    assert "voice_enabled" in issued["voice"]["reason"], issued
    admin = await ticket_for(bridge, ADMIN_TOKEN)
    assert admin["device_id"] == "browser-admin" and admin["ticket"] != issued["ticket"]


def test_tickets_are_one_use_expire_and_are_kept_only_as_hashes() -> None:
    clock = ManualClock()
    tickets = TalkTickets(30.0, clock=clock)
    first, second = tickets.issue("aaaaaaaaaaaa"), tickets.issue("aaaaaaaaaaaa")
    assert first not in repr(tickets._by_hash) and second not in repr(tickets._by_hash)
    assert tickets.redeem(first) == "aaaaaaaaaaaa"
    assert tickets.redeem(first) is None  # used
    clock.advance(30.0)
    assert tickets.redeem(second) is None  # expired
    assert tickets.redeem(None) is None and tickets.redeem("") is None
    assert tickets.redeem("x" * 10_000) is None
    # A key holds a few at most; issuing more forgets its oldest.
    many = [tickets.issue("bbbbbbbbbbbb") for _ in range(10)]
    assert len(tickets) == 4
    assert tickets.redeem(many[0]) is None and tickets.redeem(many[-1]) == "bbbbbbbbbbbb"


# ---- the device endpoint -----------------------------------------------------------------------


async def test_the_browser_becomes_the_device_browser_key_id_until_it_closes(
    bridge: Bridge,
) -> None:
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    device_id = issued["device_id"]
    with capture_logs() as logs:
        async with talking_device(bridge, issued["ticket"]) as device:
            ready = await wait_state(bridge, device_id)
            assert ready.transport == "browser"
            summary = bridge.registry.summary(device_id)
            assert summary["transport"] == "browser" and summary["state"] == "ready"
            # To the page it is the stock protocol: the hello says "websocket".
            assert device.server_hello is not None
            assert device.server_hello["transport"] == "websocket"
            tools = [tool.name for tool in ready.tool_list()]
            assert "self.audio_speaker.set_volume" in tools
            # The admin API calls its tools like any device's.
            async with httpx.AsyncClient(
                base_url=bridge.api_url,
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                timeout=10,
            ) as api:
                called = await api.post(
                    f"/api/devices/{device_id}/tools/call",
                    json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 12}},
                )
            assert called.status_code == 200 and not called.json()["isError"]
            assert device.mcp.calls[-1] == ("self.audio_speaker.set_volume", {"volume": 12})
        await eventually(lambda: bridge.registry.get(device_id) is None)
    assert bridge.registry.summary(device_id)["state"] == "offline"
    # The ticket never reaches a log line.
    assert issued["ticket"] not in json.dumps(logs, default=str)


VOLUME_TOOL = "self.audio_speaker.set_volume"


def tool_calls(device: VoiceDevice) -> list[dict[str, Any]]:
    return [message for _, message in device.events if message.get("type") == "tool_call"]


async def test_the_tool_calls_of_the_devices_own_turns_reach_its_socket(bridge: Bridge) -> None:
    """A typed question (`listen detect`, answered in text: voice is off) that sets the volume:
    the socket gets one `tool_call` after the `stt`; a call by anyone else is not sent."""
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    device_id = issued["device_id"]
    async with talking_device(bridge, issued["ticket"]) as device:
        ready = await wait_state(bridge, device_id)
        await ready.call_tool(VOLUME_TOOL, {"volume": 12}, actor="key:someone")  # not its turn
        await device.listen_detect("Set the volume to 30.")
        reply = await device.wait_turn()
        assert device.mcp.calls[-1] == (VOLUME_TOOL, {"volume": 30})
        await eventually(lambda: bool(tool_calls(device)))
        await asyncio.sleep(0.2)  # nothing more on its way
        [call] = tool_calls(device)
        assert call["tool"] == VOLUME_TOOL and call["arguments"] == {"volume": 30}
        assert call["outcome"] == "ok" and call["error"] is None and call["server"] is None
        assert 0 <= call["duration_ms"] < 5_000
        kinds = [message.get("type") for _, message in device.events]
        assert kinds.index("stt") < kinds.index("tool_call"), kinds
        assert reply.transcript == "Set the volume to 30." and reply.sentences
    # The page has gone: a later call of its device's actor finds no socket and costs nothing.
    await eventually(lambda: bridge.registry.get(device_id) is None)
    actor = f"device:{device_id}"
    bridge.registry.emit(EventKind.TOOL_CALLED, device_id, tool=VOLUME_TOOL, actor=actor)
    assert bridge.browser is not None and not bridge.browser._sends


@dataclass(frozen=True)
class _Event:
    device_id: str
    detail: dict[str, Any] = field(default_factory=dict)
    kind: str = "tool_called"
    origin: str | None = None


def test_a_tool_call_message_fits_the_link_and_names_an_external_server() -> None:
    huge = {"text": "x" * 10_000}
    event = _Event("mcp:search", {"tool": "web_search", "arguments": huge, "outcome": "ok"})
    text = tool_call_text(event, 4096)
    assert len(text.encode()) <= 4096
    message = json.loads(text)
    assert message["type"] == "tool_call" and message["server"] == "search"
    assert message["tool"] == "web_search" and message["arguments"] is None
    small = json.loads(tool_call_text(_Event("browser-x", {"tool": "t", "arguments": {}}), 4096))
    assert small["server"] is None and small["arguments"] == {}


async def test_the_key_scopes_do_not_follow_the_browser_device(bridge: Bridge) -> None:
    """A talk-only key makes a device; it does not get to read or call that device."""
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    async with talking_device(bridge, issued["ticket"]):
        await wait_state(bridge, issued["device_id"])
        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as client:
            path = f"/api/devices/{issued['device_id']}"
            assert (await client.get(path)).status_code == 403
            assert (await client.get("/api/devices")).status_code == 403
            call = {"name": "self.audio_speaker.set_volume", "arguments": {"volume": 1}}
            assert (await client.post(f"{path}/tools/call", json=call)).status_code == 403


async def test_a_ticket_is_refused_when_unknown_reused_or_missing(bridge: Bridge) -> None:
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    assert await refused_status(device_url(bridge, None)) == 401
    assert await refused_status(device_url(bridge, "made-up-ticket")) == 401
    assert await refused_status(device_url(bridge, "x" * 4000)) == 401
    async with connect(device_url(bridge, issued["ticket"])) as ws:
        assert (await hello(ws))["type"] == "hello"
        assert await refused_status(device_url(bridge, issued["ticket"])) == 401  # used
    assert await refused_status(device_url(bridge, issued["ticket"])) == 401


async def test_an_expired_ticket_is_refused(bridge: Bridge) -> None:
    assert bridge.browser is not None
    clock = ManualClock()
    bridge.browser.tickets = TalkTickets(30.0, clock=clock)
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    clock.advance(30.5)
    assert await refused_status(device_url(bridge, issued["ticket"])) == 401
    fresh = await ticket_for(bridge, token)
    clock.advance(29.0)
    async with connect(device_url(bridge, fresh["ticket"])) as ws:
        await hello(ws)


async def test_a_ticket_of_a_revoked_key_is_refused(bridge: Bridge, api: httpx.AsyncClient) -> None:
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    assert (await api.delete(f"/api/keys/{key_id_of(token)}")).status_code in (200, 204)
    assert await refused_status(device_url(bridge, issued["ticket"])) == 401
    assert bridge.registry.get(issued["device_id"]) is None


async def test_another_sites_origin_is_refused_and_the_ticket_kept(bridge: Bridge) -> None:
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    url = device_url(bridge, issued["ticket"])
    for origin in ("http://evil.example", "null", f"http://localhost.evil:{bridge.http_port}"):
        assert await refused_status(url, origin=origin) == 403  # type: ignore[arg-type]
    own = bridge.api_url  # the page's own origin, as a browser sends it
    async with connect(url, origin=own) as ws:  # type: ignore[arg-type]
        assert (await hello(ws))["transport"] == "websocket"


async def test_an_oversized_message_closes_the_link_with_1009(bridge_factory: Any) -> None:
    bridge = await bridge_factory(max_message_bytes=4096)
    for big in ("x" * 5000, b"\x00" * 5000):
        token = await create_key(bridge, "console:talk")  # a device each: see the last line
        issued = await ticket_for(bridge, token)
        device_id: str = issued["device_id"]
        async with connect(device_url(bridge, issued["ticket"])) as ws:
            await hello(ws)
            await eventually(lambda: bridge.registry.get(device_id) is not None)  # noqa: B023
            await ws.send(big)
            with pytest.raises(ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 5)
            assert ws.close_code == 1009
        await eventually(lambda: bridge.registry.get(device_id) is None)  # noqa: B023
        # Cut off for breaking a bound: its next handshake waits (the stock device rule).
        again = await ticket_for(bridge, token)
        assert await refused_status(device_url(bridge, again["ticket"])) == 429


async def test_junk_binary_is_dropped_and_a_flood_of_it_is_cut_off(bridge_factory: Any) -> None:
    bridge = await bridge_factory(voice_enabled=True, max_inbound_messages_per_s=20.0)
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    async with talking_device(bridge, issued["ticket"], "opus") as device:
        await wait_state(bridge, issued["device_id"])
        await device.listen_start("auto")
        ws = device.link._ws  # type: ignore[attr-defined]
        assert ws is not None
        for junk in (b"\xff" * 7, b"", b"\x00" * 300):
            await ws.send(junk)
        # Still a working device after a few junk frames: a tool call goes through.
        device_obj = bridge.registry.require(issued["device_id"])
        result = await device_obj.call_tool("self.get_device_status", {})
        assert not result.is_error
        sent = 0
        with pytest.raises(ConnectionClosed):
            while sent < 5_000:
                await ws.send(b"\xfe" * 40)
                sent += 1
                await asyncio.sleep(0)
        assert sent < 5_000
        await ws.wait_closed()
        assert ws.close_code == 1008
    # Cut off for flooding: its next handshake waits like a stock device's.
    again = await ticket_for(bridge, token)
    assert await refused_status(device_url(bridge, again["ticket"])) == 429


# Serial: the burst must outrun the bucket's refill; in the parallel phase's load it did not
# (every refusal was 401), and the voice turn's recognition heard "set volume" once there.
@pytest.mark.serial
async def test_a_burst_of_bad_tickets_is_refused_429_and_costs_few_log_lines(
    bridge_factory: Any,
) -> None:
    # Loopback counts like any address; the address's handshake budget (30, hardly refilled) is
    # what runs out, not the admin listener's connection rate (set high): the same outcome
    # however slow the machine is.
    bridge = await bridge_factory(
        rate_limit_exempt=[],
        rate_limits={
            "handshake_ip": {"per_s": 0.01, "burst": 30},
            "connection_ip": {"per_s": 1000, "burst": 1000},
        },
    )
    statuses: list[int] = []
    with capture_logs() as logs:
        for index in range(80):
            statuses.append(await refused_status(device_url(bridge, f"guess-{index}")))
    assert statuses[:30] == [401] * 30 and statuses[-1] == 429
    assert set(statuses) == {401, 429}
    refusals = [entry for entry in logs if "talk handshake refused" in entry["event"]]
    assert len(refusals) <= 12, len(refusals)


# ---- a voice turn ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.parametrize("audio_format", ["pcm16", "opus"])
async def test_a_spoken_command_through_the_browser_endpoint_is_answered_aloud(
    bridge_factory: Any, audio_format: str
) -> None:
    bridge = await bridge_factory(voice_enabled=True)
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    assert issued["voice"] == {"available": True, "reason": None}
    async with talking_device(bridge, issued["ticket"], audio_format) as device:
        await wait_state(bridge, issued["device_id"])
        reply = await speak_turn(device, spoken("set the volume to thirty"))
        await eventually(lambda: bool(device.mcp.calls))
        await eventually(lambda: bool(tool_calls(device)))
        assert tool_calls(device)[-1]["arguments"] == {"volume": 30}
    # The stock messages as a stock device gets them, and the page's `tool_call` after `stt`
    # (usually before `llm`, which the call's result decides; the page places it either way).
    assert reply.kinds.index("stt") < reply.kinds.index("tool_call"), reply.kinds
    stock = [kind for kind in reply.kinds if kind != "tool_call"]
    assert stock[:3] == ["stt", "llm", "tts start"], reply.kinds
    assert stock[-1] == "tts stop" and "tts sentence_start" in stock
    assert (reply.transcript or "").lower().startswith("set the volume")
    assert device.mcp.calls[-1] == ("self.audio_speaker.set_volume", {"volume": 30})
    assert reply.audio.duration_ms > 500


async def test_a_second_tab_of_the_same_key_replaces_the_first(bridge: Bridge) -> None:
    token = await create_key(bridge, "console:talk")
    first, second = await ticket_for(bridge, token), await ticket_for(bridge, token)
    async with talking_device(bridge, first["ticket"]) as old:
        await wait_state(bridge, first["device_id"])
        async with talking_device(bridge, second["ticket"]) as new:
            await eventually(lambda: old.closed_reason is not None)
            ready = await wait_state(bridge, second["device_id"])
            result = await ready.call_tool("self.get_device_status", {})
            assert not result.is_error
            assert new.mcp.calls == [("self.get_device_status", {})] and old.mcp.calls == []


async def test_the_ticket_in_the_url_is_masked_in_the_access_log(
    bridge: Bridge, caplog: pytest.LogCaptureFixture
) -> None:
    token = await create_key(bridge, "console:talk")
    issued = await ticket_for(bridge, token)
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        async with connect(device_url(bridge, issued["ticket"])) as ws:
            await hello(ws)
        assert await refused_status(device_url(bridge, "guessed-ticket")) == 401
    lines = [record.getMessage() for record in caplog.records]
    assert any("/console/device?ticket=***" in line for line in lines), lines
    assert not any(issued["ticket"] in line or "guessed-ticket" in line for line in lines)
