"""`esp32-bridge keys ...` and `esp32-bridge chat` as real subprocesses against a running bridge
that created its own tokens (as `serve` does); chat runs offline (no model)."""

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from backend.config import Settings
from backend.server import Bridge
from testkit.stock_device import WireDevice, stock_tools
from tests.helpers import create_key, run_cli, wait_state


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Bridge, WireDevice, str]]:
    settings = Settings.on_loopback(
        tmp_path / "data",
        llm_provider="none",
        search_enabled=False,
    )
    async with Bridge(settings) as bridge:
        device = WireDevice(bridge.ws_url, bridge.tokens.device, tools=stock_tools())
        await device.connect()
        await wait_state(bridge, device.device_id)
        yield bridge, device, str(settings.data_dir)
        await device.close()


async def status(bridge: Bridge, token: str, path: str) -> int:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as client:
        return (await client.get(path)).status_code


async def test_keys_create_list_revoke(served):
    bridge, device, data_dir = served
    code, out, err = await run_cli(
        "keys",
        "create",
        "kitchen app",
        "--scope",
        "chat:use",
        "--scope",
        "devices:call",
        "--device",
        device.device_id,
        "--data-dir",
        data_dir,
    )
    assert code == 0, err
    key_id = re.search(r"created key ([0-9a-f]{12}) \(kitchen app\)", out).group(1)
    token = re.search(r"^(esk_\S+)$", out, re.MULTILINE).group(1)
    assert "shown once" in out and device.device_id in out
    assert await status(bridge, token, "/v1/models") == 200
    assert await status(bridge, token, f"/api/devices/{device.device_id}/tools") == 200
    assert await status(bridge, token, "/api/keys") == 403

    code, out, err = await run_cli("keys", "list", "--data-dir", data_dir)
    assert code == 0, err
    row = next(line for line in out.splitlines() if key_id in line)
    assert "kitchen app" in row and "chat:use, devices:call" in row and "active" in row
    assert device.device_id in row and token not in out

    code, out, err = await run_cli("keys", "revoke", key_id, "--data-dir", data_dir)
    assert (code, out.strip()) == (0, f"revoked key {key_id} (kitchen app)"), err
    assert await status(bridge, token, "/v1/models") == 401
    code, out, _ = await run_cli("keys", "list", "--active", "--data-dir", data_dir)
    assert code == 0 and out.strip() == "no keys"


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["keys", "create", "x", "--scope", "chat:abuse"], 2, "chat:abuse"),
        (["keys", "create", "x"], 2, "--scope"),
        (["keys", "revoke", "000000000000"], 1, "no API key '000000000000'"),
    ],
)
async def test_keys_errors(served, args, code, message):
    _bridge, _device, data_dir = served
    exit_code, out, err = await run_cli(*args, "--data-dir", data_dir)
    assert exit_code == code and message in err, (out, err)
    assert "Traceback" not in err


async def test_keys_need_the_admin_scope(served):
    bridge, _device, data_dir = served
    token = await create_key(bridge, "chat:use")
    code, _, err = await run_cli("keys", "list", "--token", token, "--data-dir", data_dir)
    assert code == 1 and "lacks the scope admin" in err and "Traceback" not in err


async def test_chat_streams_tool_lines_and_answers_in_one_conversation(served):
    bridge, device, data_dir = served
    code, out, err = await run_cli(
        "chat",
        "--device",
        device.device_id,
        "--data-dir",
        data_dir,
        stdin="Set the volume to 30\n\nHow long should I brush my teeth?\n",
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[:3] == [
        '  [tool] self.audio_speaker.set_volume {"volume":30}',
        "  [tool] self.audio_speaker.set_volume → true",
        "Volume set to 30.",
    ]
    assert device.volume == 30
    assert "2 minutes" in out and "\nSources:\n1. " in out
    conversation_id = re.search(r"^conversation (\w+)$", out, re.MULTILINE).group(1)
    stored = await bridge.frontends.memory.get(conversation_id, with_messages=True)
    assert [m.content for m in stored.messages if m.role == "user"] == [
        "Set the volume to 30",
        "How long should I brush my teeth?",
    ]

    code, out, err = await run_cli(
        "chat",
        "--conversation",
        conversation_id,
        "--data-dir",
        data_dir,
        stdin="How often should I floss?\n/quit\nignored\n",
    )
    assert code == 0, err
    stored = await bridge.frontends.memory.get(conversation_id)
    assert stored.message_count == 6


async def test_chat_with_a_key_without_chat_use(served):
    bridge, _device, data_dir = served
    token = await create_key(bridge, "devices:read")
    code, _, err = await run_cli(
        "chat", "--token", token, "--data-dir", data_dir, stdin="How often should I floss?\n"
    )
    assert code == 1 and "lacks the scope chat:use" in err and "Traceback" not in err


async def test_chat_refuses_a_device_tool_without_devices_call(served):
    bridge, device, data_dir = served
    token = await create_key(bridge, "chat:use")
    code, out, err = await run_cli(
        "chat",
        "--device",
        device.device_id,
        "--data-dir",
        data_dir,
        stdin="Set the volume to 30\n",
        env={"BRIDGE_API_KEY": token},
    )
    assert code == 0, err
    assert "  [tool] self.audio_speaker.set_volume failed: missing scope devices:call" in out
    assert device.volume == 50


@pytest.mark.parametrize(
    ("how", "named"),
    [("env", "BRIDGE_API_KEY"), ("flag", "--token"), ("admin", "BRIDGE_ADMIN_TOKEN")],
)
async def test_a_refused_token_names_where_it_came_from(served, how, named):
    """A bad key says which variable or option to fix, not another one."""
    _bridge, _device, data_dir = served
    args = ["chat", "--data-dir", data_dir]
    env = {"BRIDGE_API_KEY": "", "BRIDGE_ADMIN_TOKEN": ""}
    if how == "env":
        env["BRIDGE_API_KEY"] = "not-a-key"
    elif how == "flag":
        args += ["--token", "not-a-key"]
    else:
        env["BRIDGE_ADMIN_TOKEN"] = "not-a-key"
    code, _, err = await run_cli(*args, env=env, stdin="How often should I floss?\n")
    assert code == 1
    (line,) = err.strip().splitlines()
    assert line.endswith(f"check {named}" if how != "admin" else "admin_token in the config file)")
    assert named in line
    for other in {"BRIDGE_API_KEY", "--token", "BRIDGE_ADMIN_TOKEN"} - {named}:
        assert other not in line
