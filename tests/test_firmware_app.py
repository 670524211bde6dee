"""The firmware's app loop (firmware/lib/app.py + transport_ws + mcp_server + tools_stock) against
a minimal bridge played by a real `websockets` server on loopback: in-process under CPython, and
firmware/main.py as a subprocess under the MicroPython unix port."""

import asyncio
import gc
import json
import re
import secrets
import socket
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request

from backend.firmware import firmware_dir
from simulator.firmware import firmware_module
from tests.firmware_helpers import (
    needs_micropython,
    run_micropython,
    running_firmware,
    serving,
)

app_module = firmware_module("app")
hal_fake = firmware_module("hal_fake")
mcp_server = firmware_module("mcp_server")
tools_stock = firmware_module("tools_stock")
transport_ws = firmware_module("transport_ws")

TOKEN = "device-token"
DEVICE_ID = "a4:cf:12:34:56:78"
CLIENT_ID = "3b8f3e52-5c1a-4d3e-9f55-2f4a8c6d7e90"
SERVER_AUDIO = {"format": "opus", "sample_rate": 24000, "channels": 1, "frame_duration": 60}


class DeviceLink:
    """The bridge's side of one device connection."""

    def __init__(self, connection: ServerConnection, hello: dict[str, Any], session_id: str):
        self.connection = connection
        self.headers: Headers = connection.request.headers  # type: ignore[union-attr]
        self.hello = hello
        self.session_id = session_id
        self.inbox: asyncio.Queue[str | bytes] = asyncio.Queue()
        self.closed = asyncio.Event()

    async def send(self, message: Any) -> None:
        await self.connection.send(
            message if isinstance(message, str | bytes) else json.dumps(message)
        )

    def message(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A message of this session: what the bridge sends, and what the device must send."""
        return {"session_id": self.session_id, "type": kind, **fields}

    async def mcp(self, payload: dict[str, Any]) -> None:
        await self.send(self.message("mcp", payload=payload))

    async def call(
        self, request_id: int, name: str, arguments: dict[str, Any] | None = None
    ) -> None:
        params: dict[str, Any] = {"name": name, "arguments": arguments or {}}
        await self.mcp(
            {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}
        )

    async def ping(self, request_id: int) -> dict[str, Any]:
        await self.mcp({"jsonrpc": "2.0", "id": request_id, "method": "ping"})
        return await self.next_json()

    async def next_json(self) -> dict[str, Any]:
        message = await asyncio.wait_for(self.inbox.get(), 30)  # slow on a loaded CI machine
        assert isinstance(message, str), message
        return json.loads(message)


class FakeBridge:
    """Checks nothing itself: it records headers and hellos, and the tests assert on them."""

    def __init__(self) -> None:
        self.links: asyncio.Queue[DeviceLink] = asyncio.Queue()
        self.reject_next = 0  # answer this many upgrades with 401
        self.send_hello = True
        self.port = 0

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/xiaozhi/v1/"

    async def process_request(self, connection: ServerConnection, request: Request) -> Any:
        if self.reject_next:
            self.reject_next -= 1
            return connection.respond(401, "invalid device token\n")
        return None

    async def handler(self, connection: ServerConnection) -> None:
        link = None
        try:
            hello = json.loads(await connection.recv())
            session_id = secrets.token_hex(16)
            link = DeviceLink(connection, hello, session_id)
            if self.send_hello:
                await connection.send(
                    json.dumps(
                        {
                            "type": "hello",
                            "transport": "websocket",
                            "session_id": session_id,
                            "audio_params": SERVER_AUDIO,
                        }
                    )
                )
            await self.links.put(link)
            async for message in connection:
                await link.inbox.put(message)
        except ConnectionClosed:
            pass
        finally:
            if link is not None:
                link.closed.set()

    async def next_link(self) -> DeviceLink:
        return await asyncio.wait_for(self.links.get(), 30)


@pytest.fixture
async def bridge() -> AsyncIterator[FakeBridge]:
    async with serving(FakeBridge()) as fake:
        yield fake


def ok_reply(request_id: int, text: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "result": {"content": [{"type": "text", "text": text}], "isError": False},
    }


class SlowTool:
    """An async tool that waits until released, and notes whether it was cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = False

    async def __call__(self, args: dict[str, Any]) -> str:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return "slow " + args["label"]


class Device:
    """The firmware app in this process, with a fake HAL and the stock tools."""

    def __init__(self, url: str, hal: Any = None, **config: Any) -> None:
        self.hal = hal or hal_fake.HalFake(board_name="test-board", firmware_version="9.9.9")
        self.server = mcp_server.McpServer("test-board", "9.9.9")
        tools_stock.register(self.server, self.hal)
        self.slow = SlowTool()
        self.server.add_tool("test.slow", "Waits.", [mcp_server.string("label")], self.slow)
        self.server.add_tool("test.huge", "Too big.", [], lambda args: "h" * 70_000)
        self.logs: list[str] = []
        settings = {
            "url": url,
            "token": TOKEN,
            "device_id": DEVICE_ID,
            "client_id": CLIENT_ID,
            "reconnect_min_s": 0.05,
            "reconnect_max_s": 0.2,
            **config,
        }
        self.app = app_module.App(
            settings, self.hal, self.server, transport_ws.WsTransport, log=self.logs.append
        )
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "Device":
        self.task = asyncio.create_task(self.app.run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.app.stop()
        assert self.task is not None
        await asyncio.wait_for(self.task, 10)  # stop() alone must end run()


async def wait_until(condition: Any) -> None:
    async def poll() -> None:
        while not condition():  # noqa: ASYNC110  (state owned by the code under test)
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), 10)


# ---- CPython, in process ---------------------------------------------------------------------


async def test_headers_hello_and_session(bridge: FakeBridge) -> None:
    async with Device(bridge.url) as device:
        link = await bridge.next_link()
        await asyncio.wait_for(device.app.ready_event.wait(), 10)
        assert device.app.connected
        assert device.app.session_id == link.session_id
        assert device.app.connections == 1
    assert link.headers["Authorization"] == f"Bearer {TOKEN}"
    assert link.headers["Device-Id"] == DEVICE_ID
    assert link.headers["Client-Id"] == CLIENT_ID
    assert link.headers["Protocol-Version"] == "1"
    assert link.hello["type"] == "hello"
    assert link.hello["version"] == 1
    assert link.hello["transport"] == "websocket"
    assert link.hello["features"]["mcp"] is True
    assert not device.app.connected


async def test_tool_call_reply_carries_session_and_id(bridge: FakeBridge) -> None:
    async with Device(bridge.url) as device:
        link = await bridge.next_link()
        await link.call(7, "self.audio_speaker.set_volume", {"volume": 42})
        assert await link.next_json() == link.message("mcp", payload=ok_reply(7, "true"))
        assert device.hal.volume == 42
        await link.call(8, "self.audio_speaker.set_volume", {"volume": 101})
        error = (await link.next_json())["payload"]
        assert error["id"] == 8
        assert error["error"]["message"] == "Value exceeds maximum allowed: 100"
        assert device.hal.changes == [("volume", 42)]


async def test_slow_async_call_does_not_block_and_can_be_cancelled(bridge: FakeBridge) -> None:
    async with Device(bridge.url) as device:
        link = await bridge.next_link()
        await link.call(20, "test.slow", {"label": "first"})
        await asyncio.wait_for(device.slow.started.wait(), 10)
        assert device.app.pending_calls == 1
        # The link keeps serving while the tool waits.
        await link.call(21, "self.audio_speaker.set_volume", {"volume": 10})
        assert (await link.next_json())["payload"] == ok_reply(21, "true")
        cancel = {"requestId": 20, "reason": "user gave up"}
        await link.mcp({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": cancel})
        await wait_until(lambda: device.slow.cancelled)
        assert device.app.pending_calls == 0
        device.slow.release.set()
        # A later call is answered, and nothing for id 20 came before it.
        assert (await link.ping(22))["payload"] == {"jsonrpc": "2.0", "id": 22, "result": {}}
        assert link.inbox.empty()
        assert "link: call 20 cancelled by the server" in device.logs


async def test_async_call_reply_arrives_when_the_tool_finishes(bridge: FakeBridge) -> None:
    async with Device(bridge.url) as device:
        link = await bridge.next_link()
        await link.call(30, "test.slow", {"label": "second"})
        await asyncio.wait_for(device.slow.started.wait(), 10)
        device.slow.release.set()
        reply = await link.next_json()
        assert reply["session_id"] == link.session_id
        assert reply["payload"] == ok_reply(30, "slow second")
        assert device.app.pending_calls == 0


async def test_reply_over_the_frame_limit_becomes_an_error(bridge: FakeBridge) -> None:
    async with Device(bridge.url):
        link = await bridge.next_link()
        await link.call(40, "test.huge")
        payload = (await link.next_json())["payload"]
        assert payload["id"] == 40
        assert payload["error"]["code"] == -32603
        assert "exceeds the 65535-byte limit" in payload["error"]["message"]


async def test_garbage_is_logged_and_the_link_stays_up(bridge: FakeBridge) -> None:
    async with Device(bridge.url) as device:
        link = await bridge.next_link()
        for junk in (
            "not json {",
            "[1, 2, 3]",
            '{"type": 5}',
            '{"type": "nonsense"}',
            '{"type": "mcp", "payload": "x"}',
            '{"type": "mcp"}',
            b"\x00\xff" * 100,
            b"\x01",
        ):
            await link.send(junk)
        # Bad mcp payloads get a JSON-RPC error (id null); then the link still answers.
        for _ in range(2):
            assert (await link.next_json())["payload"]["error"]["code"] == -32600
        assert (await link.ping(50))["payload"]["id"] == 50
        assert device.app.connections == 1
        assert device.app.ignored_binary == 2
        logs = "\n".join(device.logs)
        assert "ignored invalid message: 'not json {'" in logs
        assert "ignored message type nonsense" in logs
        assert logs.count("ignoring binary frames") == 1


async def test_display_and_system_messages_reach_the_hal(bridge: FakeBridge) -> None:
    async with Device(bridge.url) as device:
        link = await bridge.next_link()
        await link.send({"type": "stt", "text": "what time is it"})
        await link.send({"type": "tts", "state": "start"})
        await link.send({"type": "tts", "state": "sentence_start", "text": "It is noon."})
        await link.send({"type": "llm", "text": "😊", "emotion": "happy"})
        await link.send({"type": "alert", "status": "Error", "message": "boom", "emotion": "sad"})
        await link.send({"type": "alert", "status": "incomplete"})
        await link.send({"type": "system", "command": "reboot"})
        await link.ping(60)
        assert device.hal.shown == [
            ("user", "what time is it"),
            ("assistant", "It is noon."),
            ("system", "emotion: happy"),
            ("alert", "Error: boom"),
        ]
        assert device.hal.reboots == 1


async def test_memory_error_in_a_handler_is_survived(bridge: FakeBridge) -> None:
    class StarvedHal(hal_fake.HalFake):
        def show(self, role: str, text: str) -> None:
            raise MemoryError

    async with Device(bridge.url, hal=StarvedHal()) as device:
        link = await bridge.next_link()
        await link.send({"type": "stt", "text": "hello"})
        assert (await link.ping(70))["payload"]["id"] == 70
        assert "link: out of memory handling a message; dropped it" in device.logs
        assert device.app.connections == 1


async def test_out_of_memory_request_gets_an_error_reply(
    bridge: FakeBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with Device(bridge.url) as device:
        link = await bridge.next_link()

        def exhausted(payload: Any) -> Any:
            raise MemoryError

        monkeypatch.setattr(device.server, "handle_message", exhausted)
        await link.mcp({"jsonrpc": "2.0", "id": 75, "method": "tools/list"})
        await link.mcp({"jsonrpc": "2.0", "method": "notifications/initialized"})
        reply = (await link.next_json())["payload"]
        assert reply == {
            "jsonrpc": "2.0",
            "id": 75,
            "error": {"code": -32603, "message": "Out of memory"},
        }
        monkeypatch.undo()
        assert (await link.ping(76))["payload"]["id"] == 76  # nothing was sent for the notification
        assert device.app.connections == 1
        assert "link: out of memory handling a message; dropped it" in device.logs


async def test_reply_that_runs_out_of_memory_becomes_an_error(bridge: FakeBridge) -> None:
    class StarvedTransport(transport_ws.WsTransport):
        async def send(self, message: str | bytes) -> None:
            if isinstance(message, str) and '"result"' in message:
                raise MemoryError
            await super().send(message)

    device = Device(bridge.url)
    device.app.transport_factory = StarvedTransport
    async with device:
        link = await bridge.next_link()
        await link.call(90, "self.audio_speaker.set_volume", {"volume": 1})
        reply = (await link.next_json())["payload"]
        assert reply["id"] == 90
        assert reply["error"] == {"code": -32603, "message": "Out of memory sending the reply"}
        assert device.app.connections == 1


async def test_text_input_is_sent_as_listen_detect(bridge: FakeBridge) -> None:
    async with Device(bridge.url) as device:
        link = await bridge.next_link()
        await asyncio.wait_for(device.app.ready_event.wait(), 10)
        reader = asyncio.StreamReader()
        reader.feed_data("turn on the light\n\n\xff\n".encode("latin-1"))
        reader.feed_data(b"and the fan\n")
        reader.feed_eof()
        await app_module.console_input(device.app, reader)
        first, second = await link.next_json(), await link.next_json()
        assert first == link.message("listen", state="detect", text="turn on the light")
        assert second["text"] == "and the fan"
        assert "console: input is not UTF-8; line ignored" in device.logs


async def test_text_input_without_a_session_is_refused(bridge: FakeBridge) -> None:
    device = Device(bridge.url)
    assert await device.app.send_text("hello?") is False
    assert device.logs == ["link: not connected; text not sent"]


async def test_reconnects_after_close_and_after_a_dropped_socket(bridge: FakeBridge) -> None:
    async with Device(bridge.url) as device:
        first = await bridge.next_link()
        await first.connection.close(1001, "bridge restarting")
        second = await bridge.next_link()
        await wait_until(lambda: device.app.ready_event.is_set())
        assert device.app.session_id == second.session_id != first.session_id
        second.connection.transport.abort()  # TCP gone, no close frame (like a stock device)
        third = await bridge.next_link()
        await third.call(80, "self.audio_speaker.set_volume", {"volume": 5})
        reply = await third.next_json()
        assert reply["session_id"] == third.session_id
        assert reply["payload"] == ok_reply(80, "true")
        assert device.app.connections == 3
        assert any(
            "closed by the server (code 1001); reconnecting in" in line for line in device.logs
        )


async def test_stop_then_cancel_closes_cleanly(bridge: FakeBridge) -> None:
    """What the simulator does to a device: stop(), then cancel its task at once."""
    loop_errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, context: loop_errors.append(context)
    )
    device = Device(bridge.url)
    task = asyncio.create_task(device.app.run())
    link = await bridge.next_link()
    await asyncio.wait_for(device.app.ready_event.wait(), 10)
    device.app.stop()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.wait_for(link.closed.wait(), 10)
    assert link.connection.close_code == 1000
    assert not device.app.connected
    for _ in range(3):  # let the background close finish, then collect finished tasks
        await asyncio.sleep(0)
    gc.collect()
    assert loop_errors == []  # e.g. "Task exception was never retrieved"


async def test_rejection_is_logged_and_retried(bridge: FakeBridge) -> None:
    bridge.reject_next = 2
    async with Device(bridge.url) as device:
        await bridge.next_link()
        await wait_until(lambda: device.app.connections == 1)
    rejected = [line for line in device.logs if "rejected: HTTP 401" in line]
    assert len(rejected) == 2
    assert rejected[0].startswith("link: connect failed: HandshakeError: rejected: HTTP 401")


async def test_missing_server_hello_times_out_and_retries(
    bridge: FakeBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app_module, "HELLO_TIMEOUT_S", 0.1)
    bridge.send_hello = False
    async with Device(bridge.url) as device:
        await bridge.next_link()
        await bridge.next_link()
        assert not device.app.ready_event.is_set()
    assert any("no server hello within 0.1 s; reconnecting" in line for line in device.logs)


async def test_unreachable_bridge_is_retried_with_backoff() -> None:
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with Device(f"ws://127.0.0.1:{port}/") as device:
        await wait_until(lambda: sum("connect failed" in line for line in device.logs) >= 3)
    delays = [float(m) for m in re.findall(r"reconnecting in ([0-9.]+) s", "\n".join(device.logs))]
    assert all(0.05 <= delay <= 0.2 for delay in delays)
    assert delays[-1] > delays[0]  # doubled from the minimum towards the maximum
    assert device.app.connections == 0


# ---- MicroPython unix port: firmware/main.py as a process --------------------------------------


@pytest.mark.micropython
@needs_micropython
async def test_micropython_main_against_the_bridge(bridge: FakeBridge, tmp_path: Path) -> None:
    config = {"url": bridge.url, "token": TOKEN, "hal": "fake", "reconnect_min_s": 0.05}
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    async with running_firmware(config_path, piped_stdin=True) as device:
        link = await bridge.next_link()
        client_id = (tmp_path / "client_id").read_text()
        assert uuid.UUID(client_id).version == 4
        assert link.headers["Client-Id"] == client_id
        assert re.fullmatch(r"02(:[0-9a-f]{2}){5}", link.headers["Device-Id"])
        assert link.headers["Authorization"] == f"Bearer {TOKEN}"
        assert link.hello["features"]["mcp"] is True

        await link.call(1, "self.audio_speaker.set_volume", {"volume": 42})
        assert await link.next_json() == link.message("mcp", payload=ok_reply(1, "true"))
        await device.wait_for_line("[hal] volume = 42", timeout_s=10)

        await link.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        names = [tool["name"] for tool in (await link.next_json())["payload"]["result"]["tools"]]
        assert names[:2] == ["self.get_device_status", "self.audio_speaker.set_volume"]

        await link.send("garbage that is not JSON")
        await link.send(b"\x00" * 500)
        await link.send({"type": "tts", "state": "sentence_start", "text": "Hello there"})
        await device.wait_for_line("[assistant] Hello there", timeout_s=10)

        await device.type_line("what is the weather")
        detect = await link.next_json()
        assert detect == link.message("listen", state="detect", text="what is the weather")

        await link.connection.close()
        second = await bridge.next_link()
        assert second.headers["Client-Id"] == client_id  # persisted identity
        await second.call(3, "self.led.set", {"on": True, "brightness": 30})
        assert (await second.next_json())["payload"] == ok_reply(3, "true")
        prefix = "[hal] led = "
        await wait_until(lambda: any(line.startswith(prefix) for line in device.lines))
        led_line = next(line for line in device.lines if line.startswith(prefix))
        assert json.loads(led_line[len(prefix) :]) == {"on": True, "brightness": 30}
    assert "link: ignored invalid message: 'garbage that is not JSON'" in device.output
    assert "Traceback" not in device.output


@pytest.mark.micropython
@needs_micropython
@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "not found: copy config.example.json"),
        ("{broken", "is not valid JSON"),
        ('{"url": "ws://h/", "transport": "udp"}', "\"transport\" 'udp' is not supported"),
        ('{"transport": "mqtt"}', '"mqtt" must be an object'),
        ('{"transport": "mqtt", "mqtt": {"url": "ws://h/"}}', '"mqtt.url": MQTT URL must start'),
        (
            '{"ota_url": "http://h/o/", "transport": "mqtt", "mqtt": {"url": "ws://h/"}}',
            '"mqtt.url": MQTT URL must start',
        ),
        ('{"url": "wss://h/"}', "TLS not supported on this build"),
        ('{"token": "x"}', '"ota_url" (e.g. "http://192.168.1.10:8002/xiaozhi/ota/") or "url"'),
        ('{"ota_url": "https://h/xiaozhi/ota/"}', '"ota_url": OTA URL must start with http://'),
    ],
)
async def test_micropython_main_refuses_a_bad_config(
    tmp_path: Path, content: str | None, message: str
) -> None:
    config_path = tmp_path / "config.json"
    if content is not None:
        config_path.write_text(content)
    code, stdout, stderr = await run_micropython(
        firmware_dir() / "main.py", str(config_path), timeout_s=30
    )
    lines = stdout.splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("config error: ")
    assert message in lines[0]
    assert stderr == ""
