"""Risky device tools (reboot, upgrade, settings, `destructiveHint`) need an explicit
confirmation: the admin API's `"confirm": true`, the CLI's `--confirm`, a "yes" in the next chat
turn. Policy per tool and per device. A real bridge, a stock device over a real WebSocket, the
fake LLM on loopback."""

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from backend import metrics
from backend.chat import (
    ChatService,
    DeviceToolBox,
    Done,
    Token,
    ToolCompleted,
    ToolFailed,
    ToolStarted,
    TurnRequest,
    collect,
)
from backend.chat.llm import OpenAiProvider, Usage
from backend.server import Bridge
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from testkit.stock_device import STATUS_TOOL, VOLUME_TOOL, WireDevice
from tests.helpers import run_cli, wait_state

MAC = "a4:cf:12:34:56:78"
UPGRADE = "self.firmware.upgrade"
ERASE = "self.storage.erase"
REBOOT = "self.reboot"


def risky_tools() -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {}}
    url = {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}
    return [
        STATUS_TOOL,
        VOLUME_TOOL,
        {"name": UPGRADE, "description": "Upgrade the firmware from a URL.", "inputSchema": url},
        {
            "name": ERASE,
            "description": "Erase stored data.",
            "inputSchema": schema,
            "annotations": {"destructiveHint": True},
        },
        {
            "name": REBOOT,
            "description": "Reboot.",
            "inputSchema": schema,
            "annotations": {"audience": ["user"]},
        },
    ]


@pytest.fixture
async def device(bridge: Bridge) -> AsyncIterator[WireDevice]:
    wire = WireDevice(bridge.ws_url, DEVICE_TOKEN, MAC, tools=risky_tools())
    await wire.connect()
    await wait_state(bridge, MAC)
    yield wire
    await wire.close()


def called(device: WireDevice) -> list[str]:
    return [name for name, _arguments in device.stock.calls]


async def call(
    api: httpx.AsyncClient, name: str, device_id: str = MAC, **body: Any
) -> httpx.Response:
    return await api.post(f"/api/devices/{device_id}/tools/call", json={"name": name, **body})


async def test_the_api_refuses_risky_tools_without_confirm(
    api: httpx.AsyncClient, device: WireDevice
) -> None:
    for name, arguments, reason in (
        (REBOOT, {}, "rule '*.reboot'"),
        (UPGRADE, {"url": "http://x/f.bin"}, "rule '*upgrade*'"),
        (ERASE, {}, "destructiveHint"),
    ):
        listed = (await api.get(f"/api/devices/{MAC}/tools")).json()["tools"]
        assert next(t for t in listed if t["name"] == name)["needs_confirmation"] is True
        refused = await call(api, name, arguments=arguments)
        assert refused.status_code == 428, refused.text
        error = refused.json()["error"]
        assert error["code"] == "confirmation_required"
        assert reason in error["message"] and '"confirm": true' in error["message"]
    assert called(device) == []

    for name, arguments in ((REBOOT, {}), (UPGRADE, {"url": "http://x/f.bin"}), (ERASE, {})):
        done = await call(api, name, arguments=arguments, confirm=True)
        assert done.status_code == 200, done.text
    assert called(device) == [REBOOT, UPGRADE, ERASE]
    # A harmless tool needs nothing, and is listed so.
    assert (await call(api, "self.audio_speaker.set_volume", arguments={"volume": 5})).is_success
    listed = (await api.get(f"/api/devices/{MAC}/tools")).json()["tools"]
    harmless = next(t for t in listed if t["name"] == "self.audio_speaker.set_volume")
    assert harmless["needs_confirmation"] is False


async def test_the_cli_needs_confirm_for_a_risky_tool(bridge: Bridge, device: WireDevice) -> None:
    server = ["--server", bridge.api_url, "--token", ADMIN_TOKEN]
    # `tools` marks what the bridge's rules hold for a confirmation, before anything is called.
    status, out, err = await run_cli("tools", MAC, "--wide", *server)
    assert status == 0, err
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("self.")}
    assert rows[REBOOT].rstrip().endswith("yes") and rows[ERASE].rstrip().endswith("yes")
    assert not rows["self.audio_speaker.set_volume"].rstrip().endswith("yes")
    status, _out, err = await run_cli("call", MAC, REBOOT, *server)
    assert status == 1 and "needs an explicit confirmation" in err and "--confirm" in err
    assert len(err.strip().splitlines()) == 1 and called(device) == []
    status, out, err = await run_cli("call", MAC, REBOOT, "--confirm", *server)
    assert (status, out.strip()) == (0, "true"), err
    assert called(device) == [REBOOT]


async def test_the_policy_is_set_per_tool_and_per_device(
    bridge_factory: Callable[..., Any],
) -> None:
    bridge: Bridge = await bridge_factory(
        confirm_tools=["*.reboot", f"!{MAC}/self.reboot", "*/self.audio_speaker.*"],
        confirm_destructive_hint=False,
    )
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    lab = WireDevice(bridge.ws_url, DEVICE_TOKEN, MAC, tools=risky_tools())
    other = WireDevice(bridge.ws_url, DEVICE_TOKEN, "a4:cf:00:00:00:02", tools=risky_tools())
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as api:
        for wire in (lab, other):
            await wire.connect()
            await wait_state(bridge, wire.device_id)
        try:
            # The tool listing says what the policy decides, per device (the console and the
            # CLI mark those tools before they are used).
            for wire, expected in (
                (lab, {"self.audio_speaker.set_volume"}),
                (other, {REBOOT, "self.audio_speaker.set_volume"}),
            ):
                listed = (await api.get(f"/api/devices/{wire.device_id}/tools")).json()["tools"]
                marked = {tool["name"] for tool in listed if tool["needs_confirmation"]}
                assert marked == expected, listed
            assert (await call(api, REBOOT)).status_code == 200  # exempt on this device
            assert (await call(api, REBOOT, "a4:cf:00:00:00:02")).status_code == 428
            assert (await call(api, ERASE)).status_code == 200  # destructiveHint switched off
            volume = await call(api, "self.audio_speaker.set_volume", arguments={"volume": 9})
            assert volume.status_code == 428  # made risky by the operator
            assert (await call(api, UPGRADE, arguments={"url": "u"})).status_code == 200
        finally:
            await lab.close()
            await other.close()


# ---- chat: ask first, call only after a yes -----------------------------------------------------


@pytest.fixture
async def chat(fake_llm: FakeLlm, bridge: Bridge) -> AsyncIterator[ChatService]:
    provider = OpenAiProvider(fake_llm.url, Usage(chat="m", guardrail="g"), timeout_s=5)
    yield ChatService(bridge.frontends.memory, provider)
    await provider.aclose()


def box(bridge: Bridge) -> DeviceToolBox:
    return DeviceToolBox(bridge.registry.require(MAC), actor="chat:test")


def turn(bridge: Bridge, text: str, conversation: str = "conv-risky") -> TurnRequest:
    return TurnRequest(text=text, device_id=MAC, conversation_id=conversation)


def spoken(events: list[Any]) -> str:
    return "".join(event.text for event in events if isinstance(event, Token))


async def test_a_chat_turn_asks_before_a_risky_tool_and_runs_it_after_yes(
    fake_llm: FakeLlm, bridge: Bridge, chat: ChatService, device: WireDevice
) -> None:
    upgrade = FakeCall("self_firmware_upgrade", {"url": "http://x/f.bin"})
    fake_llm.script("chat", Reply("Let me upgrade it.", calls=[upgrade]))
    first = await collect(
        chat.run_turn(turn(bridge, "Upgrade your firmware from http://x/f.bin"), box(bridge))
    )
    assert called(device) == []
    [failed] = [e for e in first if isinstance(e, ToolFailed)]
    assert failed.tool == UPGRADE and "confirm" in failed.error
    question = spoken(first)
    assert 'Reply "yes" to go ahead' in question and UPGRADE in question
    assert len(fake_llm.of_kind("chat")) == 1  # no second model round after the refusal
    assert isinstance(first[-1], Done) and first[-1].metadata.stored

    confirmations = metrics.REGISTRY.get_sample_value(
        "bridge_chat_turns_total", {"path": "confirmation"}
    )
    second = await collect(chat.run_turn(turn(bridge, "Yes, go ahead"), box(bridge)))
    assert called(device) == [UPGRADE]
    assert (
        metrics.REGISTRY.get_sample_value("bridge_chat_turns_total", {"path": "confirmation"})
        == (confirmations or 0) + 1
    )
    assert device.stock.calls[0][1] == {"url": "http://x/f.bin"}
    assert [type(e) for e in second if isinstance(e, ToolStarted | ToolCompleted)] == [
        ToolStarted,
        ToolCompleted,
    ]
    assert spoken(second).startswith(f"Done: {UPGRADE}")
    assert len(fake_llm.of_kind("chat")) == 1  # the confirmation needed no model
    # Asked once, answered once: another "yes" does nothing.
    third = await collect(chat.run_turn(turn(bridge, "yes"), box(bridge)))
    assert called(device) == [UPGRADE] and not any(isinstance(e, ToolStarted) for e in third)


async def test_no_or_another_conversation_never_runs_the_risky_tool(
    fake_llm: FakeLlm, bridge: Bridge, chat: ChatService, device: WireDevice
) -> None:
    erase = FakeCall("self_storage_erase", {})
    fake_llm.script("chat", Reply(calls=[erase]), Reply(calls=[erase]))
    await collect(chat.run_turn(turn(bridge, "Erase your storage"), box(bridge)))
    declined = await collect(chat.run_turn(turn(bridge, "No, cancel that"), box(bridge)))
    assert "did not run self.storage.erase" in spoken(declined)

    await collect(chat.run_turn(turn(bridge, "Erase your storage", conversation="a"), box(bridge)))
    elsewhere = await collect(chat.run_turn(turn(bridge, "yes", conversation="b"), box(bridge)))
    assert not any(isinstance(e, ToolStarted) for e in elsewhere)
    # The question in "a" is still open; an unrelated answer there drops it.
    fake_llm.script("chat", Reply("Brush twice a day."))
    await collect(
        chat.run_turn(turn(bridge, "How often should I brush?", conversation="a"), box(bridge))
    )
    await collect(chat.run_turn(turn(bridge, "yes", conversation="a"), box(bridge)))
    # A question that only starts like a yes ("có" = yes; "có nên" = should I) is not one.
    fake_llm.script("chat", Reply(calls=[erase]), Reply("Có, sau khi đánh răng."))
    await collect(chat.run_turn(turn(bridge, "Xóa bộ nhớ đi", conversation="c"), box(bridge)))
    question = "Có nên dùng nước súc miệng không?"
    answered = await collect(chat.run_turn(turn(bridge, question, conversation="c"), box(bridge)))
    assert not any(isinstance(e, ToolStarted) for e in answered)
    assert spoken(answered).startswith("Có, sau khi đánh răng.")
    assert called(device) == []


async def test_an_offline_reboot_request_reaches_the_device_and_waits_for_yes(
    bridge: Bridge, wire_devices: Any
) -> None:
    """A device whose reboot tool the chat may use: the offline rules route "reboot the
    device" to it, and the confirmation rules hold it until a "yes"."""
    tools = [STATUS_TOOL, VOLUME_TOOL, {**risky_tools()[-1], "annotations": {}}]
    device = wire_devices("a4:cf:12:34:56:79", tools=tools)
    await device.connect()
    await wait_state(bridge, device.device_id)
    offline = ChatService(bridge.frontends.memory, None)
    box = DeviceToolBox(bridge.registry.require(device.device_id), actor="chat:test")

    def request(text: str) -> TurnRequest:
        return TurnRequest(text=text, device_id=device.device_id, conversation_id="conv-reboot")

    first = await collect(offline.run_turn(request("reboot the device"), box))
    assert called(device) == []
    [failed] = [e for e in first if isinstance(e, ToolFailed)]
    assert failed.tool == REBOOT and "confirm" in failed.error
    assert 'Reply "yes" to go ahead' in spoken(first)
    second = await collect(offline.run_turn(request("yes"), box))
    assert called(device) == [REBOOT]
    assert spoken(second).startswith(f"Done: {REBOOT}")
