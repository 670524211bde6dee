"""MQTT credentials from the OTA endpoint: a device set to MQTT gets an `mqtt` section (never
with `websocket`) whose username is its device key and whose password is its own token; the
bridge's generated Mosquitto password file and the ACL of `mqtt_credentials` confine it to its
own topics on a real Mosquitto."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.server import Bridge
from backend.transports.mqtt_credentials import mosquitto_hash
from testkit.mosquitto import Mosquitto, mosquitto_available
from testkit.settings import ADMIN_TOKEN
from tests.helpers import run_cli
from tests.mqtt_wire import MqttRefused, RawMqttClient

A, B = "a4:cf:12:34:56:78", "a4:cf:00:00:00:02"
CLIENT_A, CLIENT_B = "6c4a5a2e-2f0e-4a4e-9d59-3b2d1c0e9f11", "0f8e2c61-1b7a-4c3e-9a55-7d2e0c9b1a44"

pytestmark = pytest.mark.skipif(not mosquitto_available(), reason="mosquitto not installed")


async def approved_answer(
    bridge: Bridge, http: httpx.AsyncClient, api: httpx.AsyncClient, mac: str, client: str
) -> dict[str, Any]:
    headers = {"Device-Id": mac, "Client-Id": client, "User-Agent": "bread-compact-wifi/2.4.2"}
    url = bridge.provisioning.ota_url
    code = (await http.post(url, json={}, headers=headers)).json()["activation"]["code"]
    assert (await api.post("/api/provisioning/approve", json={"target": code})).is_success
    answer: dict[str, Any] = (await http.post(url, json={}, headers=headers)).json()
    return answer


@contextlib.asynccontextmanager
async def client(
    port: int, section: dict[str, Any], **overrides: str
) -> AsyncIterator[RawMqttClient]:
    mqtt = RawMqttClient("127.0.0.1", port)
    login = {**section, **overrides}
    await mqtt.connect(login["client_id"], login["username"], login["password"])
    try:
        yield mqtt
    finally:
        await mqtt.disconnect()


async def test_mqtt_credentials_from_ota_confine_a_device_on_mosquitto(
    bridge_factory: Callable[..., Any], tmp_path: Path
) -> None:
    broker = Mosquitto(tmp_path / "mosquitto", {})
    bridge: Bridge = await bridge_factory(
        device_auth="device",
        device_transport="mqtt",
        ota_mqtt_endpoint=f"127.0.0.1:{broker.port}",
    )
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with (
        httpx.AsyncClient(timeout=10) as http,
        httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as api,
    ):
        answer_a = await approved_answer(bridge, http, api, A, CLIENT_A)
        answer_b = await approved_answer(bridge, http, api, B, CLIENT_B)
        assert "websocket" not in answer_a and "activation" not in answer_a
        mqtt_a, mqtt_b = answer_a["mqtt"], answer_b["mqtt"]
        assert mqtt_a == {
            "endpoint": f"127.0.0.1:{broker.port}",
            "client_id": f"GID_xiaozhi@@@a4_cf_12_34_56_78@@@{CLIENT_A}",
            "username": "a4_cf_12_34_56_78",
            "password": mqtt_a["password"],
            "keepalive": 240,
            "publish_topic": "xiaozhi/a4_cf_12_34_56_78/up",
            "subscribe_topic": "xiaozhi/a4_cf_12_34_56_78/down",
        }
        assert mqtt_a["password"].startswith("dtk_")
        # The broker login is the device's own token: it also opens the WebSocket.
        assert bridge.provisioning.store.refusal(A, mqtt_a["password"]) is None
        assert bridge.provisioning.store.verify(mqtt_a["username"], mqtt_a["password"])
        assert not bridge.provisioning.store.verify(mqtt_a["username"], mqtt_b["password"])

        # The operator's password file, from the bridge (hashes only), plus the bridge's login.
        passwd = tmp_path / "passwd"
        status, out, err = await run_cli(
            "devices", "mosquitto-passwd", str(passwd),
            "--server", bridge.api_url, "--token", ADMIN_TOKEN,
        )  # fmt: skip
        assert status == 0 and "2 device logins" in out, err
        text = passwd.read_text()
        assert mqtt_a["password"] not in text and mqtt_b["password"] not in text
        assert oct(passwd.stat().st_mode & 0o777) == "0o600"
        account = broker.bridge
        (broker.workdir / "passwords").write_text(
            text + f"{account.username}:{mosquitto_hash(account.password)}\n"
        )
        await broker.start()
        try:
            await confined(broker, mqtt_a, mqtt_b)
        finally:
            await broker.stop()

        # Per device: B goes back to WebSocket; without a broker endpoint nobody gets MQTT.
        status, _out, err = await run_cli(
            "devices", "transport", B, "websocket",
            "--server", bridge.api_url, "--token", ADMIN_TOKEN,
        )  # fmt: skip
        assert status == 0, err
        b_headers = {"Device-Id": B, "Client-Id": CLIENT_B}
        again = (await http.post(bridge.provisioning.ota_url, json={}, headers=b_headers)).json()
        assert "mqtt" not in again and again["websocket"]["token"] == mqtt_b["password"]


async def confined(broker: Mosquitto, mqtt_a: dict[str, Any], mqtt_b: dict[str, Any]) -> None:
    account = broker.bridge
    with pytest.raises(MqttRefused):  # A's username with B's token
        await RawMqttClient("127.0.0.1", broker.port).connect(
            mqtt_a["client_id"], mqtt_a["username"], mqtt_b["password"]
        )
    bridge_side = RawMqttClient("127.0.0.1", broker.port)
    await bridge_side.connect("bridge-test", account.username, account.password)
    try:
        assert await bridge_side.subscribe("xiaozhi/+/up") == [1]
        async with client(broker.port, mqtt_a) as dev_a, client(broker.port, mqtt_b) as dev_b:
            # Mosquitto grants B's downlink to A, then delivers nothing its ACL forbids.
            await dev_a.subscribe(mqtt_b["subscribe_topic"])
            await dev_a.subscribe(mqtt_a["subscribe_topic"])
            await dev_b.subscribe(mqtt_b["subscribe_topic"])
            await dev_a.publish(mqtt_b["publish_topic"], b'{"spoofed":true}', qos=1)
            await dev_a.publish(mqtt_a["publish_topic"], b'{"from":"a"}', qos=1)
            got = await bridge_side.next_publish()
            assert (got.topic, got.payload) == (mqtt_a["publish_topic"], b'{"from":"a"}')
            await bridge_side.publish(mqtt_b["subscribe_topic"], b'{"for":"b"}', qos=1)
            await bridge_side.publish(mqtt_a["subscribe_topic"], b'{"for":"a"}', qos=1)
            assert (await dev_b.next_publish()).payload == b'{"for":"b"}'
            first = await dev_a.next_publish()
            assert (first.topic, first.payload) == (mqtt_a["subscribe_topic"], b'{"for":"a"}')
            await asyncio.sleep(0)  # anything of B's would have come before A's own
            assert dev_a.publishes.empty() and bridge_side.publishes.empty()
    finally:
        await bridge_side.disconnect()
