"""Per-device bounds of the WebSocket link, against a live bridge over loopback sockets:
every inbound frame costs the device (decodable or not), a device that stops reading is cut off
by the write timeout, one that piles up requests without reading the answers by the in-flight
bound (docs/reliability.md). Each with small settings, and a bystander that is served."""

import asyncio
import contextlib
import json
from typing import Any

import pytest
from structlog.testing import capture_logs
from websockets.exceptions import ConnectionClosed

from backend.mcp_session.client import MAX_DEVICE_REQUESTS
from backend.protocol.audio import encode_audio
from backend.transports.errors import LinkClosed
from testkit.settings import DEVICE_TOKEN
from testkit.stock_device import WireDevice
from tests.helpers import eventually, wait_state

# Frames that break each framing version (v1 has no framing: every frame is an Opus packet).
UNDECODABLE = {
    2: b"\x00\x02\x00\x00" + b"\x00" * 8 + b"\x00\x00\xff\xff" + b"\xaa" * 64,  # size 65535
    3: b"\x00\x00\xff\xff" + b"\xaa" * 64,  # claims 65535 bytes, carries 64
}
LOG_LINE_CHARS = 1000  # no log line about one device's frames is longer than this


async def healthy_call(bridge: Any, device_id: str) -> None:
    live = await wait_state(bridge, device_id)
    result = await live.call_tool("self.audio_speaker.set_volume", {"volume": 33})
    assert result.content == [{"type": "text", "text": "true"}]


async def send_until_closed(device: WireDevice, frame: str | bytes, limit: int) -> int:
    """Send `frame` until the link closes (at most `limit` times); how many were sent."""
    assert device.ws is not None
    sent = 0
    with contextlib.suppress(ConnectionClosed):
        while sent < limit:
            await device.ws.send(frame)
            sent += 1
            if sent % 16 == 0:
                await asyncio.sleep(0)  # let the device's reader see a close frame
    return sent


def for_device(logs: list[dict[str, Any]], device_id: str) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry.get("device_id") == device_id]


@pytest.mark.parametrize(
    ("version", "frame"),
    [
        (1, b"\xf8" * 64),  # valid v1 audio, the baseline
        (2, UNDECODABLE[2]),
        (2, b"\x00\x02"),  # shorter than the v2 header
        (3, UNDECODABLE[3]),
        (3, b""),
    ],
    ids=["v1-audio", "v2-bad-size", "v2-short", "v3-bad-size", "v3-empty"],
)
async def test_undecodable_binary_frames_count_against_the_inbound_limit(
    bridge_factory: Any, version: int, frame: bytes
) -> None:
    """A flood of frames that never decode is cut off (1008) like a flood of audio, and its
    drops cost a few log lines, not one per frame."""
    bridge = await bridge_factory(max_inbound_messages_per_s=20.0)  # a burst of 40 messages
    attacker = WireDevice(
        bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:01:01", protocol_version=version
    )
    bystander = WireDevice(bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:01:02")
    try:
        with capture_logs() as logs:
            await attacker.connect()
            await bystander.connect()
            await wait_state(bridge, attacker.device_id)
            sent = await send_until_closed(attacker, frame, limit=5_000)
            assert sent < 5_000, "never cut off"
            assert attacker.ws is not None
            await attacker.ws.wait_closed()
            await eventually(lambda: bridge.registry.get(attacker.device_id) is None)
        assert attacker.ws.close_code == 1008, (attacker.ws.close_code, sent)
        mine = for_device(logs, attacker.device_id)
        cut = [entry for entry in mine if entry["event"] == "device cut off"]
        assert len(cut) == 1 and cut[0]["reason"] == "inbound rate limit exceeded"
        # Dozens of frames dropped in at most 3 lines and one counted summary.
        drops = [entry for entry in mine if entry["event"].startswith("dropped audio frame")]
        assert len(drops) <= 4 < sent, (drops, sent)
        assert len(mine) < 20, [entry["event"] for entry in mine]
        assert all(len(json.dumps(entry, default=str)) < LOG_LINE_CHARS for entry in mine)
        await healthy_call(bridge, bystander.device_id)
    finally:
        await attacker.close()
        await bystander.close()


async def test_undecodable_frames_of_60_kb_empty_the_byte_bucket(bridge_factory: Any) -> None:
    bridge = await bridge_factory(max_inbound_bytes_per_s=100_000.0)  # a burst of 200 kB
    attacker = WireDevice(bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:01:03", protocol_version=3)
    try:
        await attacker.connect()
        await wait_state(bridge, attacker.device_id)
        big = b"\x00\x00\xff\xff" + b"\xaa" * 60_000
        sent = await send_until_closed(attacker, big, limit=1_000)
        assert sent < 1_000, "never cut off"
        assert attacker.ws is not None
        await attacker.ws.wait_closed()
        assert attacker.ws.close_code == 1008, (attacker.ws.close_code, sent)
    finally:
        await attacker.close()


@pytest.mark.parametrize("chars", [60_000, 200], ids=["large-texts", "small-texts"])
async def test_a_device_that_stops_reading_is_closed_by_the_write_timeout(
    bridge_factory: Any, chars: int
) -> None:
    bridge = await bridge_factory(write_timeout_s=0.3)
    victim = WireDevice(bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:02:01")
    bystander = WireDevice(bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:02:02")
    try:
        with capture_logs() as logs:
            await victim.connect()
            await bystander.connect()
            await wait_state(bridge, victim.device_id)
            await wait_state(bridge, bystander.device_id)
            await victim.stop_reader()  # from now on the victim reads nothing
            conversation = bridge.conversations.conversation(victim.device_id)
            # Small texts go out untimed while nothing is buffered: once the socket buffers are
            # full, they queue in the transport and the next write is timed.
            text = "x" * chars
            sent = 0
            with pytest.raises(LinkClosed, match="write timed out"):
                async with asyncio.timeout(60):  # a guard, not a measurement
                    while True:  # until the socket buffers are full and a write times out
                        await conversation.send_stt(text)
                        sent += 1
            await eventually(lambda: bridge.registry.get(victim.device_id) is None)
            # The bystander was never held up by the victim's full buffers.
            await healthy_call(bridge, bystander.device_id)
        assert sent > 0
        gone = [
            e for e in for_device(logs, victim.device_id) if e["event"] == "device disconnected"
        ]
        assert len(gone) == 1, gone
    finally:
        await victim.kill()  # its reading is paused: it would not notice a close
        await bystander.close()


async def test_requests_piling_up_unread_hit_the_in_flight_bound(bridge_factory: Any) -> None:
    """A device that keeps sending requests while it reads none of the answers: once
    MAX_DEVICE_REQUESTS answers wait to be written, it is cut off with 1008."""
    bridge = await bridge_factory(
        # Only the in-flight bound may stop it here: no rate limit, no write timeout in reach.
        max_inbound_messages_per_s=1_000_000.0,
        max_inbound_bytes_per_s=1e9,
        write_timeout_s=600.0,
    )
    device = WireDevice(bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:03:01")
    bystander = WireDevice(bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:03:02")
    filler: asyncio.Task[None] | None = None
    try:
        with capture_logs() as logs:
            await device.connect()
            await bystander.connect()
            await wait_state(bridge, device.device_id)
            await device.stop_reader()
            conversation = bridge.conversations.conversation(device.device_id)

            async def fill() -> None:  # big frames until the link's buffers are full
                with contextlib.suppress(LinkClosed):
                    while True:
                        await conversation.send_stt("x" * 60_000)

            filler = asyncio.create_task(fill())
            ping = {"session_id": device.session_id, "type": "mcp", "payload": None}
            assert device.ws is not None
            with contextlib.suppress(ConnectionClosed):
                async with asyncio.timeout(60):  # a guard, not a measurement
                    for n in range(1_000_000):
                        ping["payload"] = {"jsonrpc": "2.0", "id": n, "method": "ping"}
                        await device.ws.send(json.dumps(ping))
                        if bridge.registry.get(device.device_id) is None:
                            break
            await eventually(lambda: bridge.registry.get(device.device_id) is None, 30)
            await healthy_call(bridge, bystander.device_id)
        mine = for_device(logs, device.device_id)
        cut = [entry for entry in mine if entry["event"] == "device cut off"]
        assert len(cut) == 1, cut
        assert cut[0]["reason"] == f"more than {MAX_DEVICE_REQUESTS} requests in flight"
        gone = [entry for entry in mine if entry["event"] == "device disconnected"]
        assert len(gone) == 1 and "1008" in gone[0]["reason"], gone
    finally:
        if filler is not None:
            filler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await filler
        await device.kill()  # its reading is paused: it would not notice a close
        await bystander.close()


def test_the_v2_and_v3_junk_really_is_junk() -> None:
    """The frames above break their framing (so the test is about undecodable frames)."""
    from backend.protocol.audio import AudioFrameError, decode_audio

    for version, frame in UNDECODABLE.items():
        with pytest.raises(AudioFrameError):
            decode_audio(version, frame)
    assert decode_audio(3, encode_audio(3, b"\xaa" * 64)).payload == b"\xaa" * 64
