"""End to end over MQTT + UDP: the whole bridge (session, MCP client, registry, admin API, CLI)
with the embedded endpoint or a real Mosquitto, and simulated devices that run the firmware's own
code (app loop, transport_mqtt on umqtt.simple, MCP server, stock tools) on CPython."""

import asyncio
import contextlib
import json
import os
import signal
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.auth import Tokens
from backend.devices import DeviceState
from backend.devices.conversation import Conversation
from backend.protocol.audio import AudioFrame
from backend.server import Bridge
from backend.transports.mqtt_credentials import DerivedCredentials
from backend.transports.mqtt_topics import TopicScheme
from simulator import MqttOptions, SimulatedDevice
from testkit.mosquitto import Mosquitto
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN, make_settings
from tests.helpers import CLI, STARTED, eventually, run_cli, start_cli
from tests.mqtt_wire import MqttRefused, RawMqttClient

SECRET = "mqtt-secret-for-the-tests-0123456789"
CREDENTIALS = DerivedCredentials(SECRET.encode())
SCHEME = TopicScheme("xiaozhi")
EXTRA_TOOLS = 60  # tools/list spans several 8000-byte pages
WAIT_S = 10.0


def password(device_id: str) -> str:
    return CREDENTIALS.issue(device_id).password


def mqtt_settings(data_dir: Path, broker_url: str, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "mqtt_url": broker_url,
        "mqtt_host": "127.0.0.1",
        "mqtt_port": 0,
        "mqtt_secret": SECRET,
        "udp_host": "127.0.0.1",
        "udp_port": 0,
    }
    values.update(overrides)
    return make_settings(data_dir, **values)


@contextlib.asynccontextmanager
async def running_bridge(
    data_dir: Path, broker_url: str, **overrides: Any
) -> AsyncIterator[Bridge]:
    bridge = Bridge(
        mqtt_settings(data_dir, broker_url, **overrides), Tokens(ADMIN_TOKEN, DEVICE_TOKEN)
    )
    await bridge.start()
    try:
        yield bridge
    finally:
        await bridge.stop()


def broker_url(bridge: Bridge) -> str:
    assert bridge.mqtt is not None
    return bridge.mqtt.device_url


class Fleet:
    """Simulated devices, stopped at teardown."""

    def __init__(self) -> None:
        self.devices: list[SimulatedDevice] = []

    def start(
        self, url: str, index: int, *, stock: bool = False, extra_tools: int = 0
    ) -> SimulatedDevice:
        device = SimulatedDevice(
            url,
            None,
            index,
            extra_tools=extra_tools,
            reconnect_min_s=0.1,
            mqtt=MqttOptions(password, stock=stock),
        )
        device.app.reconnect_max_s = 1.0
        device.start()
        self.devices.append(device)
        return device

    async def stop(self) -> None:
        await asyncio.gather(*(device.stop() for device in self.devices))


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    devices = Fleet()
    yield devices
    await devices.stop()


@pytest.fixture
async def embedded_bridge(tmp_path: Path) -> AsyncIterator[Bridge]:
    async with running_bridge(tmp_path / "data", "embedded") as bridge:
        yield bridge


def device_logins(*indexes: int) -> dict[str, str]:
    from simulator.fleet import device_id_for

    return {
        CREDENTIALS.issue(device_id_for(i)).username: password(device_id_for(i)) for i in indexes
    }


def api(bridge: Bridge) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30)


async def call(
    client: httpx.AsyncClient, device_id: str, name: str, arguments: dict[str, Any]
) -> httpx.Response:
    return await client.post(
        f"/api/devices/{device_id}/tools/call", json={"name": name, "arguments": arguments}
    )


# ---- devices over MQTT through the API and the CLI ----------------------------------------------


async def test_mqtt_devices_are_listed_and_their_tools_called_through_api_and_cli(
    embedded_bridge: Bridge, fleet: Fleet
) -> None:
    bridge = embedded_bridge
    ours = fleet.start(broker_url(bridge), 1, extra_tools=EXTRA_TOOLS)
    stock = fleet.start(broker_url(bridge), 2, stock=True)
    for device in (ours, stock):
        await bridge.registry.wait_for_state(device.device_id, timeout_s=WAIT_S)
    async with api(bridge) as client:
        listed = (await client.get("/api/devices")).json()["devices"]
        by_id = {row["device_id"]: row for row in listed}
        assert by_id[ours.device_id]["transport"] == "mqtt"
        assert by_id[stock.device_id]["transport"] == "mqtt"
        assert by_id[ours.device_id]["state"] == "ready"
        tools = (await client.get(f"/api/devices/{ours.device_id}/tools")).json()["tools"]
        names = {tool["name"] for tool in tools}
        assert "sim.synthetic_059" in names and "self.audio_speaker.set_volume" in names
        assert len(json.dumps(tools)) > 2 * 8000  # it took several pages
        response = await call(
            client, ours.device_id, "self.audio_speaker.set_volume", {"volume": 42}
        )
        assert response.status_code == 200, response.text
        assert ours.hal.volume == 42
    code, out, err = await run_cli(
        "call", stock.device_id, "self.audio_speaker.set_volume", "--arg", "volume=17",
        "--server", bridge.api_url, "--token", ADMIN_TOKEN,
    )  # fmt: skip
    assert code == 0, err
    assert out.strip() == "true"
    assert stock.hal.volume == 17
    code, out, err = await run_cli("devices", "--server", bridge.api_url, "--token", ADMIN_TOKEN)
    assert code == 0, err
    assert out.count(" mqtt ") >= 2


async def test_mcp_runs_before_any_hello_and_an_idle_device_serves_its_tools(
    embedded_bridge: Bridge, fleet: Fleet
) -> None:
    device = fleet.start(broker_url(embedded_bridge), 3)
    ready = await embedded_bridge.registry.wait_for_state(device.device_id, timeout_s=WAIT_S)
    # No hello in either direction: the device never opened a conversation.
    assert device.app.conversations == 0 and device.app.session_id == ""
    assert not device.app.in_conversation
    result = await ready.call_tool("self.get_device_status", {})
    assert not result.is_error
    assert json.loads(result.content[0]["text"])["audio_speaker"]["volume"] == device.hal.volume


async def test_stock_simulator_through_mosquitto_gets_nothing(tmp_path: Path, fleet: Fleet) -> None:
    """Mosquitto cannot subscribe a client that subscribes to nothing: a stock device's hello and
    the bridge's MCP requests never reach it (docs/mqtt.md, "Which broker")."""
    mosquitto = Mosquitto(tmp_path / "mosquitto", device_logins(4), bridge=None)
    await mosquitto.start()
    try:
        async with running_bridge(
            tmp_path / "data", mosquitto.bridge_url, init_timeout_s=1.0
        ) as bridge:
            device = fleet.start(f"mqtt://127.0.0.1:{mosquitto.port}", 4, stock=True)
            await eventually(lambda: device.app.connected, WAIT_S)
            assert bridge.registry.get(device.device_id) is None  # no will, no presence: unseen
            assert not await device.app.open_conversation()  # its hello is never answered
            # The hello made it visible; the MCP handshake it got in return never arrived.
            found = await bridge.registry.wait_for_state(
                device.device_id, DeviceState.FAILED, timeout_s=WAIT_S
            )
            assert found.transport == "mqtt"
    finally:
        await mosquitto.stop()


# ---- ACL ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("broker", ["embedded", "mosquitto"])
async def test_a_device_cannot_publish_as_another_or_read_its_downlink(
    broker: str, tmp_path: Path, fleet: Fleet
) -> None:
    from simulator.fleet import device_id_for

    victim_id, intruder_id = device_id_for(5), device_id_for(6)
    victim_key = CREDENTIALS.issue(victim_id).username
    intruder_key = CREDENTIALS.issue(intruder_id).username
    mosquitto = None
    if broker == "mosquitto":
        mosquitto = Mosquitto(tmp_path / "mosquitto", device_logins(5, 6))
        await mosquitto.start()
    try:
        url = mosquitto.bridge_url if mosquitto else "embedded"
        async with running_bridge(tmp_path / "data", url) as bridge:
            port = mosquitto.port if mosquitto else bridge.mqtt.endpoint.port  # type: ignore[union-attr]
            intruder = RawMqttClient("127.0.0.1", port)
            await intruder.connect(intruder_key, intruder_key, password(intruder_id))
            await intruder.subscribe(SCHEME.down(victim_key))  # granted or not: nothing comes
            victim = fleet.start(f"mqtt://127.0.0.1:{port}", 5, stock=False)
            ready = await bridge.registry.wait_for_state(victim_id, timeout_s=WAIT_S)
            await ready.call_tool("self.audio_speaker.set_volume", {"volume": 11})
            # Posing as the victim: a goodbye and a forged MCP reply on its uplink topic.
            forged = {"session_id": "", "type": "goodbye"}
            await intruder.publish(SCHEME.up(victim_key), json.dumps(forged), qos=1)
            await intruder.publish(SCHEME.status(victim_key), b"offline", qos=1)
            await ready.call_tool("self.audio_speaker.set_volume", {"volume": 12})
            assert bridge.registry.require(victim_id).state is DeviceState.READY
            assert victim.hal.volume == 12
            # Everything the bridge sent the victim (initialize, tools/list, two calls) skipped
            # the intruder's subscription to the victim's downlink.
            received = []
            while not intruder.publishes.empty():
                received.append(intruder.publishes.get_nowait().topic)
            assert SCHEME.down(victim_key) not in received
            await intruder.abort()
    finally:
        if mosquitto is not None:
            await mosquitto.stop()


async def test_a_last_will_cannot_speak_for_another_device(
    embedded_bridge: Bridge, fleet: Fleet
) -> None:
    """Issue #16's critical hole, against the whole bridge: a will on the victim's uplink that
    would have said "set the volume to 3" is refused at CONNECT; the same text published on the
    victim's topic reaches nobody; the victim stays ready and its volume is only ever ours."""
    from simulator.fleet import device_id_for

    bridge = embedded_bridge
    port = bridge.mqtt.endpoint.port  # type: ignore[union-attr]
    victim_id, intruder_id = device_id_for(7), device_id_for(8)
    victim_key = CREDENTIALS.issue(victim_id).username
    intruder_key = CREDENTIALS.issue(intruder_id).username
    victim = fleet.start(f"mqtt://127.0.0.1:{port}", 7, stock=False)
    ready = await bridge.registry.wait_for_state(victim_id, timeout_s=WAIT_S)
    await ready.call_tool("self.audio_speaker.set_volume", {"volume": 40})
    spoken = json.dumps({"type": "listen", "state": "detect", "text": "set the volume to 3"})
    for topic in (SCHEME.up(victim_key), SCHEME.status(victim_key)):
        intruder = RawMqttClient("127.0.0.1", port)
        with pytest.raises(MqttRefused) as refused:
            await intruder.connect(
                intruder_key,
                intruder_key,
                password(intruder_id),
                will=(topic, spoken.encode(), 1, False),
            )
        assert refused.value.code == 5
        await intruder.abort()
    intruder = RawMqttClient("127.0.0.1", port)
    await intruder.connect(intruder_key, intruder_key, password(intruder_id))
    await intruder.publish(SCHEME.up(victim_key), spoken, qos=1)
    await intruder.publish(
        SCHEME.up(victim_key), json.dumps({**json.loads(spoken), "text": "yes"}), qos=1
    )
    await intruder.abort()
    await ready.call_tool("self.audio_speaker.set_volume", {"volume": 41})
    assert victim.hal.volume == 41
    assert bridge.registry.require(victim_id).state is DeviceState.READY
    # A login that was never issued does not make a device appear.
    stranger = RawMqttClient("127.0.0.1", port)
    with pytest.raises(MqttRefused):
        await stranger.connect("a4_00_00_00_00_99", "a4_00_00_00_00_99", "guess")
    await stranger.abort()
    assert bridge.registry.get("a4:00:00:00:00:99") is None


# ---- the broker goes away and comes back --------------------------------------------------------


@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_broker_restart_fails_pending_calls_clearly_and_everything_comes_back(
    how: str, tmp_path: Path, fleet: Fleet
) -> None:
    """Killed, the broker just vanishes: "broker connection lost". Stopped (SIGTERM), Mosquitto
    first publishes every client's last will, so the bridge hears "device offline" first."""
    mosquitto = Mosquitto(tmp_path / "mosquitto", device_logins(7, 8))
    await mosquitto.start()
    try:
        async with running_bridge(tmp_path / "data", mosquitto.bridge_url) as bridge:
            url = f"mqtt://127.0.0.1:{mosquitto.port}"
            devices = [fleet.start(url, 7, extra_tools=1), fleet.start(url, 8, extra_tools=1)]
            for device in devices:
                await bridge.registry.wait_for_state(device.device_id, timeout_s=WAIT_S)
            async with api(bridge) as client:
                slow = asyncio.create_task(
                    call(client, devices[0].device_id, "sim.synthetic_000", {"delay_ms": 30_000})
                )
                await eventually(
                    lambda: bridge.registry.require(devices[0].device_id).mcp.pending_count > 0, 5
                )
                await (mosquitto.kill() if how == "kill" else mosquitto.stop())
                response = await asyncio.wait_for(slow, WAIT_S)
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert error["code"] == "device_disconnected"
                # Killed mid-call, the broker may first make the bridge's pending publish time out
                # ("publish failed"), a clear reason too (seen once under load).
                reasons = ["broker connection lost", "publish failed"]
                reasons += ["device offline"] if how == "stop" else []
                assert any(reason in error["message"] for reason in reasons), error
                await mosquitto.start()
                loop = asyncio.get_running_loop()
                restarted = loop.time()
                for device in devices:
                    await bridge.registry.wait_for_state(device.device_id, timeout_s=WAIT_S)
                assert loop.time() - restarted < 10.0
                response = await call(
                    client, devices[1].device_id, "self.audio_speaker.set_volume", {"volume": 5}
                )
                assert response.status_code == 200, response.text
    finally:
        await mosquitto.stop()


# ---- conversation: hello, UDP audio both ways, goodbye both ways --------------------------------


async def test_hello_over_mqtt_opens_udp_audio_both_ways_and_goodbye_both_ways(
    embedded_bridge: Bridge, fleet: Fleet
) -> None:
    bridge = embedded_bridge
    device = fleet.start(broker_url(bridge), 9)
    await bridge.registry.wait_for_state(device.device_id, timeout_s=WAIT_S)
    uplink: list[tuple[str, AudioFrame]] = []
    opened: list[str] = []
    ended: list[tuple[str, str]] = []
    downlink: list[bytes] = []
    device.app.on_audio = downlink.append
    bridge.conversations.on_audio(lambda c, frame: uplink.append((c.device_id, frame)))
    bridge.conversations.on_opened(lambda c, hello: opened.append(c.session_id))
    bridge.conversations.on_ended(lambda c, reason: ended.append((c.session_id, reason)))

    assert await device.app.open_conversation()
    session_id = device.app.session_id
    assert opened == [session_id]
    conversation: Conversation = bridge.conversations.conversation(device.device_id)
    assert conversation.session_id == session_id
    udp = device.app._transport.audio  # the firmware's UdpAudio of this conversation
    assert udp is not None and udp.port == bridge.mqtt.udp.port  # type: ignore[union-attr]
    assert len(udp.key) == 16 and udp.nonce[0] == 1

    frames = [bytes([n]) * (40 + n) for n in range(5)]
    for frame in frames:
        assert device.app.send_audio(frame)
    await eventually(lambda: len(uplink) == len(frames), WAIT_S)
    assert [frame.payload for _, frame in uplink] == frames  # decrypted by the bridge
    for n in range(3):
        await conversation.send_audio(b"tts-%d" % n, timestamp_ms=60 * n)
    await eventually(lambda: len(downlink) == 3, WAIT_S)
    assert downlink == [b"tts-0", b"tts-1", b"tts-2"]  # decrypted by the device

    # The device ends it: goodbye with its session id.
    assert await device.app.goodbye()
    await eventually(lambda: len(ended) == 1, WAIT_S)
    assert ended[0] == (session_id, "goodbye from the device")

    # A new hello, a new session; the bridge ends this one with the current session id.
    assert await device.app.open_conversation()
    second = device.app.session_id
    assert second != session_id
    await bridge.conversations.conversation(device.device_id).goodbye()
    await eventually(lambda: not device.app.in_conversation, WAIT_S)
    # Each conversation ended exactly once (the new hello found nothing left to replace).
    assert ended == [
        (session_id, "goodbye from the device"),
        (second, "goodbye from the bridge"),
    ]
    await bridge.conversations.conversation(device.device_id).goodbye()  # nothing open: no-op
    assert len(ended) == 2
    # MCP still works after both conversations.
    ready = bridge.registry.require(device.device_id)
    assert not (await ready.call_tool("self.audio_speaker.set_volume", {"volume": 3})).is_error


async def test_stock_simulator_through_the_embedded_broker_talks_and_streams(
    embedded_bridge: Bridge, fleet: Fleet
) -> None:
    bridge = embedded_bridge
    device = fleet.start(broker_url(bridge), 10, stock=True)
    await bridge.registry.wait_for_state(device.device_id, timeout_s=WAIT_S)
    transport = device.app._transport
    assert transport.stock and transport.client_id.startswith("GID_xiaozhi@@@02_00_")
    got: list[bytes] = []
    bridge.conversations.on_audio(lambda c, frame: got.append(frame.payload))
    assert await device.app.open_conversation()
    assert device.app.send_audio(b"opus!")
    await eventually(lambda: got == [b"opus!"], WAIT_S)


# ---- CLI: serve --mqtt, simulate --transport mqtt, mqtt credentials --------------------------


async def test_mqtt_credentials_are_accepted_by_the_embedded_broker(
    tmp_path: Path, embedded_bridge: Bridge
) -> None:
    env = {"BRIDGE_MQTT_SECRET": SECRET}
    where = ("--data-dir", str(tmp_path / "cli"))
    code, out, err = await run_cli(
        "mqtt", "credentials", "A4:CF:12:34:56:78", "--json", *where, env=env
    )
    assert code == 0, err
    assert 'device_auth is "device" (the default)' in err  # this password is for shared mode
    record = json.loads(out)
    assert record["username"] == "a4_cf_12_34_56_78"
    assert record["publish_topic"] == "xiaozhi/a4_cf_12_34_56_78/up"
    assert SECRET not in out + err
    port = embedded_bridge.mqtt.endpoint.port  # type: ignore[union-attr]
    client = RawMqttClient("127.0.0.1", port)
    await client.connect(record["client_id"], record["username"], record["password"])
    await client.publish(record["status_topic"], b"online", qos=1)
    await embedded_bridge.registry.wait_for_state(
        "a4:cf:12:34:56:78", DeviceState.INITIALIZING, timeout_s=WAIT_S
    )
    await client.abort()
    code, out, err = await run_cli("mqtt", "credentials", "a4:cf:12:34:56:78", *where, env=env)
    assert code == 0, err
    for expected in ("pattern write xiaozhi/%u/up", "a4_cf_12_34_56_78:$7$101$", "auto_subscribe"):
        assert expected in out


async def test_serve_with_embedded_broker_and_simulate_over_mqtt_as_processes(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "served"
    serve = await start_cli(
        "serve", data_dir, None,
        "--mqtt", "embedded", "--mqtt-port", "0", "--udp-public-host", "127.0.0.1",
    )  # fmt: skip
    await eventually(lambda: (data_dir / "bridge.json").exists(), 30)
    runtime = json.loads((data_dir / "bridge.json").read_text())
    assert runtime["endpoints"]["mqtt"].startswith("mqtt://127.0.0.1:")
    assert runtime["endpoints"]["mqtt_broker"] == "embedded"
    assert stat.S_IMODE((data_dir / "mqtt.secret").stat().st_mode) == 0o600
    secret = (data_dir / "mqtt.secret").read_text().strip()
    env = {"BRIDGE_MQTT_SECRET": "", "BRIDGE_MQTT_URL": ""}
    simulate = await asyncio.create_subprocess_exec(
        *CLI, "simulate", "--transport", "mqtt", "--devices", "2", "--stock",
        "--data-dir", str(data_dir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env},
    )  # fmt: skip
    STARTED.append(simulate)
    try:
        where = ("--data-dir", str(data_dir))

        async def ready_mqtt_devices() -> int:
            code, out, err = await run_cli("devices", "--online", *where, env=env)
            assert code == 0, err
            return sum(1 for line in out.splitlines() if " ready " in line and " mqtt " in line)

        for _ in range(500):
            if await ready_mqtt_devices() == 2:
                break
            await asyncio.sleep(0.05)
        assert await ready_mqtt_devices() == 2
        code, out, err = await run_cli(
            "call", "02:00:00:00:00:01", "self.audio_speaker.set_volume", "--arg", "volume=9",
            *where, env=env,
        )  # fmt: skip
        assert code == 0, err
        assert out.strip() == "true"
    finally:
        simulate.terminate()
        await simulate.wait()
        serve.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(serve.communicate(), 15)
    banner = out.decode()
    assert "mqtt: devices at mqtt://127.0.0.1:" in banner and "(the bridge's own endpoint" in banner
    assert secret not in out.decode() + err.decode()  # the credential secret is never printed


async def test_serve_refuses_mqtt_without_a_public_udp_address(tmp_path: Path) -> None:
    code, _out, err = await run_cli(
        "serve", "--data-dir", str(tmp_path), "--ws-port", "0", "--http-port", "0",
        "--mqtt", "embedded", "--mqtt-port", "0",
        env={"BRIDGE_UDP_PUBLIC_HOST": "", "BRIDGE_ADMIN_TOKEN": "", "BRIDGE_DEVICE_TOKEN": ""},
    )  # fmt: skip
    assert code == 1
    assert err.strip().startswith("error: udp_public_host must be set"), err
    code, _out, err = await run_cli(
        "serve", "--data-dir", str(tmp_path), "--mqtt", "http://broker:1883",
        "--udp-public-host", "127.0.0.1",
    )  # fmt: skip
    assert code == 1
    assert "mqtt:// or mqtts://" in err
