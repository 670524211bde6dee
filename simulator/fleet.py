"""N simulated devices in one asyncio process.

Each device is the real firmware (`app.App`, `transport_ws`, `mcp_server`, `tools_stock`) over an
in-memory HAL, so it connects exactly like the stock firmware: same headers, same hello, same MCP
replies. `extra_tools` adds synthetic tools so `tools/list` spans several 8000-byte pages; they
also take a `delay_ms` argument, which makes slow calls (timeouts, cancellation) easy to test.

With `ota_url` a device first asks that OTA endpoint for its WebSocket URL and token, as stock
firmware does at boot, running the firmware's own `ota.provision` (activation included: with an
enrollment URL it is approved at once, otherwise it shows its code and waits for the operator).
"""

import asyncio
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from simulator.firmware import firmware_module

BOARD_NAME = "sim-device"
FIRMWARE_VERSION = "2.4.2-sim"
_SYNTHETIC_DESCRIPTION = (
    "Synthetic tool {index} of the simulator. Echoes `value` back after `delay_ms` "
    "milliseconds; it exists to exercise paginated tools/list and slow tool calls."
)


def device_id_for(index: int) -> str:
    """A locally administered MAC address, stable per index, like a stock Device-Id."""
    return "02:00:" + ":".join(f"{byte:02x}" for byte in index.to_bytes(4, "big"))


def client_id_for(index: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"esp32-mcp-bridge-simulator/{index}"))


@dataclass(frozen=True)
class MqttOptions:
    """How a simulated device uses MQTT (`url` is then the broker's mqtt:// URL).

    `password(device_id)` gives its broker password (username = its device key). `stock`: behave
    exactly like stock firmware (client id GID_…@@@mac@@@uuid, no will, no subscription);
    otherwise like this repository's firmware (retained `online`, last will, own subscription).
    """

    password: Callable[[str], str]
    stock: bool = False
    topic_prefix: str = "xiaozhi"
    keepalive: int | None = None


class SimulatedDevice:
    def __init__(
        self,
        url: str,
        token: str | None,
        index: int = 1,
        *,
        extra_tools: int = 0,
        device_id: str | None = None,
        log: Callable[..., None] | None = None,
        reconnect_min_s: float = 1.0,
        mqtt: MqttOptions | None = None,
        ota_url: str | None = None,
        ota_poll_s: float = 1.0,
    ) -> None:
        hal_module = firmware_module("hal_fake")
        mcp_module = firmware_module("mcp_server")
        tools_module = firmware_module("tools_stock")

        self.device_id = device_id or device_id_for(index)
        self.client_id = client_id_for(index)
        self.ota_url = ota_url
        self.ota_poll_s = ota_poll_s
        self.ota_answer: dict[str, Any] | None = None
        self.log = log or _quiet
        self.hal = hal_module.HalFake(
            board_name=BOARD_NAME,
            firmware_version=FIRMWARE_VERSION,
            mac=self.device_id,
            client_id=self.client_id,
        )
        self.server = mcp_module.McpServer(BOARD_NAME, FIRMWARE_VERSION)
        tools_module.register(self.server, self.hal)
        add_synthetic_tools(self.server, extra_tools)
        client_id = self.client_id
        config = {
            "url": url,
            "token": token or "",
            "device_id": self.device_id,
            "client_id": self.client_id,
            "protocol_version": 1,
            "reconnect_min_s": reconnect_min_s,
        }
        logger = log or _quiet
        self._mqtt_login: dict[str, Any] | None = None  # the broker login, over MQTT
        if mqtt is None:
            app_class = firmware_module("app").App
            factory = firmware_module("transport_ws").WsTransport
        else:
            app_class = mqtt_firmware_module("app_mqtt").MqttApp
            factory, self._mqtt_login = _mqtt_factory(url, self.device_id, client_id, mqtt, logger)
        self.app = app_class(config, self.hal, self.server, factory, log=logger)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        self._task = asyncio.create_task(self._run(), name=f"sim {self.device_id}")
        return self._task

    async def _run(self) -> None:
        if self.ota_url is not None:
            await self.provision(self.ota_url)
        await self.app.run()

    async def provision(self, ota_url: str) -> dict[str, Any]:
        """Ask the OTA endpoint for this device's URL and token (activating it if needed)."""
        ota = firmware_module("ota")
        protocol = firmware_module("protocol")
        answer: dict[str, Any] = await ota.provision(
            ota_url,
            self.hal,
            self.device_id,
            self.client_id,
            log=self.log,
            retry_min_s=1,
            poll_s=self.ota_poll_s,
        )
        self.ota_answer = answer
        if self._mqtt_login is not None:  # over MQTT the broker login comes from the answer
            self._mqtt_login.update(ota.mqtt_settings(answer, self._mqtt_login))
            return answer
        url, token = ota.websocket_endpoint(answer)
        self.app.url = url
        self.app.headers = protocol.handshake_headers(
            token, self.device_id, self.client_id, self.app.protocol_version
        )
        return answer

    async def stop(self) -> None:
        self.app.stop()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def mqtt_firmware_module(name: str) -> Any:
    """A firmware module that needs micropython-lib's umqtt.simple (fetched when missing)."""
    from backend.firmware import micropython_lib

    folder = str(micropython_lib.ensure())
    if folder not in sys.path:
        sys.path.append(folder)
    return firmware_module(name)


def _mqtt_factory(
    url: str, device_id: str, client_id: str, mqtt: MqttOptions, log: Callable[..., None]
) -> tuple[Callable[[str, Any], Any], dict[str, Any]]:
    """The firmware's MQTT transport factory and its config (a login `provision` may replace)."""
    transport_class = mqtt_firmware_module("transport_mqtt").MqttTransport
    config: dict[str, Any] = {
        "url": url,
        "username": _key(device_id),
        "password": mqtt.password(device_id),
        "topic_prefix": mqtt.topic_prefix,
        "stock": mqtt.stock,
    }
    if mqtt.keepalive is not None:
        config["keepalive"] = mqtt.keepalive

    def factory(_url: str, _headers: Any) -> Any:
        return transport_class(config, device_id, client_id, log=log)

    return factory, config


def _key(device_id: str) -> str:
    return device_id.lower().replace(":", "_")


def add_synthetic_tools(server: Any, count: int) -> None:
    mcp = firmware_module("mcp_server")
    properties = [
        mcp.integer("value", default=0, minimum=0, maximum=1_000_000),
        mcp.integer("delay_ms", default=0, minimum=0, maximum=600_000),
    ]
    for index in range(count):
        name = f"sim.synthetic_{index:03d}"
        server.add_tool(
            name,
            _SYNTHETIC_DESCRIPTION.format(index=index),
            properties,
            _synthetic_handler(name),
        )


def _synthetic_handler(name: str) -> Callable[[dict[str, Any]], Any]:
    async def handler(args: dict[str, Any]) -> dict[str, Any]:
        if args["delay_ms"]:
            await asyncio.sleep(args["delay_ms"] / 1000)
        return {"tool": name, "value": args["value"]}

    return handler


async def run_fleet(
    url: str,
    token: str | None,
    count: int,
    *,
    extra_tools: int = 0,
    first_index: int = 1,
    log: Callable[..., None] | None = None,
    mqtt: MqttOptions | None = None,
    ota_url: str | None = None,
) -> list[SimulatedDevice]:
    """Create and start `count` devices; they keep running (and reconnecting) until stopped.
    With `ota_url` each asks it for its URL and token first (`url`, `token` are then unused)."""
    devices = [
        SimulatedDevice(
            url,
            token,
            first_index + i,
            extra_tools=extra_tools,
            log=log,
            mqtt=mqtt,
            ota_url=ota_url,
        )
        for i in range(count)
    ]
    for device in devices:
        device.start()
        await asyncio.sleep(0)  # let each handshake start before the next
    return devices


def _quiet(*_args: Any) -> None:
    pass
