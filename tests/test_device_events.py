"""The registry owns device state: every transition emits exactly one event, whatever order the
link, the session and the registry learn about it."""

import asyncio

from backend.auth import Tokens
from backend.devices import DeviceEvent, DeviceState, EventKind
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from testkit.stock_device import WireDevice, answer_with, hang_and_signal, ok
from tests.helpers import eventually, wait_state

Recorded = list[tuple[EventKind, str, dict]]


def record(bridge: Bridge) -> Recorded:
    events: Recorded = []

    def listener(event: DeviceEvent) -> None:
        if event.kind is not EventKind.TOOL_CALLED:
            events.append((event.kind, event.device_id, dict(event.detail)))

    bridge.registry.subscribe(listener)
    return events


def kinds(events: Recorded, device_id: str) -> list[EventKind]:
    return [kind for kind, who, _ in events if who == device_id]


async def test_connect_then_ready_then_disconnect(bridge, wire_devices):
    events = record(bridge)
    device = wire_devices()
    await device.connect()
    await wait_state(bridge, device.device_id)
    await device.kill()  # TCP dropped without a close frame, as stock firmware does
    await eventually(lambda: EventKind.DISCONNECTED in kinds(events, device.device_id))
    await asyncio.sleep(0)
    assert kinds(events, device.device_id) == [
        EventKind.CONNECTED,
        EventKind.INITIALIZING,
        EventKind.READY,
        EventKind.DISCONNECTED,
    ]
    assert events[2][2] == {"tool_count": 2}
    assert "1006" in events[3][2]["reason"]
    assert bridge.registry.record(device.device_id) is not None  # remembered, offline


async def test_failed_handshake_is_one_failed_event(bridge, wire_devices):
    events = record(bridge)
    device = wire_devices()
    device.handlers["tools/list"] = answer_with(lambda p: ok(p, "not a tools object"))
    await device.connect()
    await wait_state(bridge, device.device_id, DeviceState.FAILED)
    await device.close()
    await eventually(lambda: EventKind.DISCONNECTED in kinds(events, device.device_id))
    assert kinds(events, device.device_id) == [
        EventKind.CONNECTED,
        EventKind.INITIALIZING,
        EventKind.FAILED,
        EventKind.DISCONNECTED,
    ]


async def test_a_replaced_link_goes_offline_once_and_its_late_close_is_silent(bridge, wire_devices):
    events = record(bridge)
    old = wire_devices()
    hung = asyncio.Event()
    old.handlers["tools/call"] = hang_and_signal(hung)
    await old.connect()
    first = await wait_state(bridge, old.device_id)
    pending = asyncio.create_task(first.call_tool("self.get_device_status", timeout_s=30))
    await hung.wait()

    new = wire_devices()  # same Device-Id
    await new.connect()
    await eventually(lambda: bridge.registry.get(new.device_id) is not first)
    second = await wait_state(bridge, new.device_id)
    await old.ws.wait_closed()  # the old link's close reaches the bridge after the replacement
    await new.round_trip()
    assert kinds(events, old.device_id) == [
        EventKind.CONNECTED,
        EventKind.INITIALIZING,
        EventKind.READY,
        EventKind.DISCONNECTED,  # the old link, replaced
        EventKind.CONNECTED,
        EventKind.INITIALIZING,
        EventKind.READY,
    ]
    assert events[3][2]["reason"] == "replaced by a new connection"
    assert first.state is DeviceState.OFFLINE and second.state is DeviceState.READY
    failure = await asyncio.gather(pending, return_exceptions=True)
    assert "replaced" in str(failure[0])


async def test_shutdown_takes_every_device_offline_once(tmp_path):
    bridge = Bridge(make_settings(tmp_path / "data"), Tokens(ADMIN_TOKEN, DEVICE_TOKEN))
    await bridge.start()
    events = record(bridge)
    devices = [WireDevice(bridge.ws_url, DEVICE_TOKEN, f"a4:cf:00:00:00:{i:02x}") for i in range(3)]
    for device in devices:
        await device.connect()
        await wait_state(bridge, device.device_id)
    await bridge.stop()
    for device in devices:
        assert kinds(events, device.device_id)[-1] is EventKind.DISCONNECTED
        assert kinds(events, device.device_id).count(EventKind.DISCONNECTED) == 1
        offline = [
            d for k, who, d in events if who == device.device_id and k.value == "disconnected"
        ]
        assert offline == [{"reason": "bridge shutting down"}]
        await device.ws.wait_closed()
        assert device.ws.close_code == 1001
    assert len(bridge.registry) == 0 and bridge.registry.known_count == 3


async def test_tool_list_change_is_one_event_and_no_state_change(bridge, wire_devices):
    events = record(bridge)
    device = wire_devices()
    await device.connect()
    live = await wait_state(bridge, device.device_id)
    device.tools = [*device.tools, {"name": "self.new", "inputSchema": {"type": "object"}}]
    await device.reply({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    await eventually(lambda: EventKind.TOOLS_CHANGED in kinds(events, device.device_id))
    assert kinds(events, device.device_id).count(EventKind.TOOLS_CHANGED) == 1
    assert live.state is DeviceState.READY and "self.new" in live.tools.by_name
