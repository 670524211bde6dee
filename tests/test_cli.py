"""The `esp32-bridge` CLI against a running bridge, as a real subprocess."""

import asyncio
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.config import Settings
from backend.server import Bridge
from testkit.settings import DEVICE_TOKEN
from testkit.stock_device import WireDevice
from tests.helpers import run_cli, wait_state


@pytest.fixture
async def self_configured_bridge(tmp_path: Path):
    """A bridge that created its own tokens in its data dir, as `serve` does."""
    settings = Settings.on_loopback(tmp_path / "data")
    async with Bridge(settings) as bridge:
        device = WireDevice(bridge.ws_url, bridge.tokens.device)
        await device.connect()
        await wait_state(bridge, device.device_id)
        yield bridge, device
        await device.close()


async def test_devices_tools_and_call_find_server_and_token_in_data_dir(self_configured_bridge):
    bridge, device = self_configured_bridge
    data_dir = str(bridge.settings.data_dir)

    code, out, err = await run_cli("devices", "--data-dir", data_dir)
    assert code == 0, err
    assert device.device_id in out and "ready" in out

    code, out, err = await run_cli("tools", device.device_id, "--data-dir", data_dir)
    assert code == 0, err
    assert "self.audio_speaker.set_volume" in out and "volume: integer" in out

    code, out, err = await run_cli(
        "call",
        device.device_id,
        "self.audio_speaker.set_volume",
        '{"volume": 61}',
        "--data-dir",
        data_dir,
    )
    assert (code, out.strip()) == (0, "true"), err
    assert device.volume == 61

    code, out, err = await run_cli(
        "call",
        device.device_id,
        "self.audio_speaker.set_volume",
        "--arg",
        "volume=62",
        "--data-dir",
        data_dir,
    )
    assert code == 0 and device.volume == 62, err

    code, out, err = await run_cli(
        "call", device.device_id, "self.get_device_status", "--data-dir", data_dir
    )
    assert code == 0 and json.loads(out)["audio_speaker"]["volume"] == 62


async def test_explicit_server_and_token_flags(self_configured_bridge):
    bridge, device = self_configured_bridge
    code, out, _ = await run_cli(
        "devices",
        "--server",
        bridge.api_url,
        "--token",
        bridge.tokens.admin,
        "--data-dir",
        "/nonexistent-dir",
    )
    assert code == 0 and device.device_id in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["call", "ff:ff:ff:ff:ff:ff", "self.x"], "unknown device 'ff:ff:ff:ff:ff:ff'"),
        (["call", "{device}", "self.nope"], "has no tool 'self.nope'"),
        (
            ["call", "{device}", "self.audio_speaker.setvolume"],
            "did you mean 'self.audio_speaker.set_volume'?",
        ),
        (
            ["call", "{device}", "self.audio_speaker.set_volume", "--arg", "volume=500"],
            "invalid arguments",
        ),
        (["call", "{device}", "self.audio_speaker.set_volume", "[1]"], "must be a JSON object"),
        (["call", "{device}", "self.audio_speaker.set_volume", "{bad"], "not valid JSON"),
        (["tools", "ff:ff:ff:ff:ff:ff"], "unknown device"),
    ],
)
async def test_errors_are_one_line_without_traceback(self_configured_bridge, args, message):
    bridge, device = self_configured_bridge
    args = [a.replace("{device}", device.device_id) for a in args]
    code, out, err = await run_cli(*args, "--data-dir", str(bridge.settings.data_dir))
    assert code != 0
    assert message in err
    assert "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1


async def test_bad_token_is_a_clear_error(self_configured_bridge):
    bridge, _ = self_configured_bridge
    code, _, err = await run_cli("devices", "--server", bridge.api_url, "--token", "nope")
    assert code == 1
    assert "invalid admin token" in err and "--token" in err
    assert "Traceback" not in err


async def test_unreachable_server(tmp_path):
    code, _, err = await run_cli(
        "devices", "--server", "http://127.0.0.1:9", "--token", "x", "--data-dir", str(tmp_path)
    )
    assert code == 1
    assert "cannot reach the bridge at http://127.0.0.1:9" in err and "--server" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


async def test_no_bridge_in_the_data_dir_says_how_to_point_at_one(tmp_path):
    """Without --server, the error says which data directory was looked in and which options
    and variables point at another bridge."""
    (tmp_path / "admin.token").write_text("x\n")
    env = {"BRIDGE_SERVER": "", "BRIDGE_HTTP_PORT": "9", "BRIDGE_ADMIN_TOKEN": ""}
    code, _, err = await run_cli("devices", "--data-dir", str(tmp_path), env=env)
    assert code == 1
    (line,) = err.strip().splitlines()
    assert f"no bridge runs with data directory {tmp_path}" in line
    for pointer in ("--data-dir", "BRIDGE_DATA_DIR", "--server", "BRIDGE_SERVER"):
        assert pointer in line

    # A runtime file left by a bridge that did not stop cleanly: it says so.
    (tmp_path / "bridge.json").write_text(json.dumps({"pid": 1, "api_url": "http://127.0.0.1:9"}))
    code, _, err = await run_cli("devices", "--data-dir", str(tmp_path), env=env)
    assert code == 1
    assert f"{tmp_path / 'bridge.json'} names it, but the bridge that wrote it has stopped" in err


async def test_listings_keep_ids_whole_at_80_columns_and_print_json(self_configured_bridge):
    """`devices`, `keys list`, `audit`: an id is never cut with "…" on a narrow terminal (it is
    what the next command needs); every listing has --json, one document on stdout."""
    bridge, device = self_configured_bridge
    data_dir = ["--data-dir", str(bridge.settings.data_dir)]
    code, out, err = await run_cli(
        "keys", "create", "a key with a long name for a narrow terminal", "--scope",
        "devices:read", "--scope", "chat:use", "--device", device.device_id, *data_dir,
    )  # fmt: skip
    assert code == 0, err
    key_id = out.split()[2]
    code, _, err = await run_cli(
        "call", device.device_id, "self.audio_speaker.set_volume", "--arg", "volume=33", *data_dir
    )
    assert code == 0, err
    narrow = {"COLUMNS": "80"}
    for command, ids in (
        (["devices"], [device.device_id]),
        (["keys", "list"], [key_id]),
        (["audit"], [device.device_id, "self.audio_speaker.set_volume"]),
    ):
        code, out, err = await run_cli(*command, *data_dir, env=narrow)
        assert code == 0, err
        assert max(len(line) for line in out.splitlines()) <= 80
        for wanted in ids:
            assert any(wanted in line for line in out.splitlines()), (command, wanted, out)

    listings = {
        ("devices",): lambda doc: [d["device_id"] for d in doc] == [device.device_id],
        ("devices", "--online"): lambda doc: doc[0]["state"] == "ready",
        ("devices", "pending"): lambda doc: doc == [],
        ("keys", "list"): lambda doc: [k["id"] for k in doc] == [key_id],
        ("audit",): lambda doc: doc[0]["tool"] == "self.audio_speaker.set_volume",
        ("tools", device.device_id): lambda doc: (
            "self.get_device_status" in [t["name"] for t in doc["tools"]]
        ),
        ("firmware", "releases"): lambda doc: doc == [],
        ("mcp", "servers"): lambda doc: doc == [],
    }
    for command, check in listings.items():
        code, out, err = await run_cli(*command, "--json", *data_dir, env=narrow)
        assert code == 0, (command, err)
        assert check(json.loads(out)), (command, out)


@pytest.mark.parametrize(
    ("command", "wanted", "unwanted"),
    [
        (["call"], ["[env: BRIDGE_SERVER", "[env: BRIDGE_ADMIN_TOKEN", "API key"], ["URL ."]),
        (["keys", "list"], ["--active", "--json"], ["default: revoked", "URL ."]),
        (["demo"], ["temporary directory"], []),
        (["firmware", "bundle"], ["--out", "--build"], []),
    ],
)
async def test_help_texts(command, wanted, unwanted):
    code, out, err = await run_cli(*command, "--help")
    assert code == 0, err
    text = " ".join(out.split())
    for phrase in wanted:
        assert phrase in text, (phrase, text)
    for phrase in unwanted:
        assert phrase not in text, (phrase, text)


async def test_a_misspelt_argument_name_gets_a_did_you_mean_before_the_call(
    self_configured_bridge,
):
    bridge, device = self_configured_bridge
    data_dir = ["--data-dir", str(bridge.settings.data_dir)]
    volume = device.volume
    code, out, err = await run_cli(
        "call", device.device_id, "self.audio_speaker.set_volume", "--arg", "vol=5", *data_dir
    )
    assert code == 2, out + err
    (line,) = err.strip().splitlines()
    assert 'unknown argument "vol"; did you mean "volume"?' in line
    assert "(self.audio_speaker.set_volume takes volume)" in line
    # Refused here: the bridge never saw the call (it audits every call it refuses too).
    assert device.volume == volume
    assert await bridge.audit.entries(limit=10) == []
    code, out, err = await run_cli(
        "call", device.device_id, "self.audio_speaker.set_volume", '{"volume": 7}', *data_dir
    )
    assert code == 0 and device.volume == 7, err


def _commands(command: Any, path: list[str]) -> Iterator[list[str]]:
    yield path
    for name, sub in sorted((getattr(command, "commands", None) or {}).items()):
        yield from _commands(sub, [*path, name])


def test_every_help_is_readable_at_80_columns():
    """No Python type names (`<bool>`, `<list[str]>`, `<int range> [x>=1]`), no markup eaten
    from a help text (which left `folder .`), no `{device}` in the usage line, nothing past 80
    columns; docstring paragraphs are rewrapped (no line cut short mid-sentence)."""
    import typer
    from typer.testing import CliRunner

    from backend.cli.main import app

    runner = CliRunner()
    paths = list(_commands(typer.main.get_command(app), []))
    assert ["devices", "pending"] in paths and ["firmware", "releases"] in paths
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80", "NO_COLOR": "1"})
        assert result.exit_code == 0, (path, result.output)
        text = result.output
        assert not re.search(r"<(bool|str|int|float|path|list|choice)\b", text), (path, text)
        assert "x>=" not in text and "x<=" not in text, (path, text)
        assert not re.search(r" \.(\s|$)", text, re.M), (path, text)
        usage = next(line for line in text.splitlines() if "Usage:" in line)
        assert "{" not in usage, (path, usage)
        assert max(len(line) for line in text.splitlines()) <= 80, (path, text)
    simulate = runner.invoke(app, ["simulate", "--help"], env={"COLUMNS": "80"}).output
    assert "each device enrols itself through the OTA endpoint" in " ".join(simulate.split())
    assert re.search(r"each device enrols\s+itself through the OTA endpoint, with", simulate)


async def test_version():
    import importlib.metadata

    code, out, err = await run_cli("--version")
    assert code == 0, err
    assert (
        out.strip()
        == f"esp32-bridge (esp32-mcp-bridge) {importlib.metadata.version('esp32-mcp-bridge')}"
    )


async def test_no_token_anywhere(tmp_path):
    code, _, err = await run_cli(
        "devices", "--data-dir", str(tmp_path), env={"BRIDGE_ADMIN_TOKEN": ""}
    )
    assert code == 1 and "no admin token" in err


async def test_bad_config_file(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("ws_port = 'x'\n")
    code, _, err = await run_cli("serve", "--config", str(config))
    assert code == 2 and "invalid setting 'ws_port'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("command", "alternative"),
    [(["simulate"], "--ota URL"), (["firmware", "run-host"], 'device config whose "ota_url"')],
)
async def test_device_commands_without_a_bridge_or_a_device_token(tmp_path, command, alternative):
    # Per-device tokens (the default): the devices would enrol through a running bridge. Each
    # command suggests only options it has (run-host has no --ota).
    code, _, err = await run_cli(
        *command, "--data-dir", str(tmp_path), env={"BRIDGE_DEVICE_TOKEN": ""}
    )
    assert code == 1
    assert f"no bridge running with data directory {tmp_path}" in err and alternative in err
    assert "--data-dir" in err and "--url and --token" in err
    if command[0] == "firmware":
        assert "--ota" not in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [["simulate"], ["firmware", "run-host"]])
async def test_device_commands_in_shared_mode_without_a_device_token(tmp_path, command):
    code, _, err = await run_cli(
        *command,
        "--data-dir",
        str(tmp_path),
        env={"BRIDGE_DEVICE_TOKEN": "", "BRIDGE_DEVICE_AUTH": "shared"},
    )
    assert code == 1
    assert "no device token: pass --token" in err and str(tmp_path / "device.token") in err
    assert "Traceback" not in err


async def test_simulate_spreads_devices_over_workers_and_stops_them_on_sigterm(bridge):
    import signal

    from simulator.fleet import device_id_for
    from tests.helpers import CLI, STARTED, eventually

    env = {**os.environ, "BRIDGE_DEVICE_TOKEN": DEVICE_TOKEN}
    process = await asyncio.create_subprocess_exec(
        *CLI, "simulate", "--url", bridge.ws_url, "--devices", "5", "--workers", "2",
        "--first-index", "11", stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    STARTED.append(process)
    wanted = {device_id_for(index) for index in range(11, 16)}
    await eventually(lambda: {d.device_id for d in bridge.registry} == wanted, timeout_s=30)
    for device_id in wanted:
        await wait_state(bridge, device_id, timeout_s=30)
    process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.wait(), 30)
    await eventually(lambda: len(bridge.registry) == 0, timeout_s=30)  # the workers are gone
    assert process.stdout is not None
    assert b"5 simulated devices over 2 worker processes" in await process.stdout.read()


async def test_simulate_enrols_its_devices_through_a_serve_with_per_device_tokens(tmp_path):
    import signal

    import httpx

    from simulator.fleet import device_id_for
    from tests.helpers import CLI, STARTED, eventually, start_cli

    data_dir = tmp_path / "data"
    serve = await start_cli("serve", data_dir)
    await eventually(lambda: (data_dir / "bridge.json").exists(), timeout_s=30)
    runtime = json.loads((data_dir / "bridge.json").read_text())
    assert runtime["device_auth"] == "device"
    simulate = await asyncio.create_subprocess_exec(
        *CLI, "simulate", "--devices", "3", "--data-dir", str(data_dir),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "BRIDGE_ADMIN_TOKEN": "", "BRIDGE_DEVICE_TOKEN": ""},
    )  # fmt: skip
    STARTED.append(simulate)
    admin = (data_dir / "admin.token").read_text().strip()
    wanted = {device_id_for(index) for index in (1, 2, 3)}
    async with httpx.AsyncClient(
        base_url=runtime["api_url"], headers={"Authorization": f"Bearer {admin}"}
    ) as api:

        async def ready() -> set[str]:
            listed = (await api.get("/api/devices", params={"state": "ready"})).json()
            return {device["device_id"] for device in listed["devices"]}

        async with asyncio.timeout(30):
            while await ready() != wanted:  # noqa: ASYNC110 - polling the API
                await asyncio.sleep(0.05)
        provisioned = (await api.get("/api/provisioning/devices")).json()["devices"]
        assert {d["device_id"] for d in provisioned} == wanted
        assert all(d["approved_by"].startswith("auto:enrollment:") for d in provisioned)
        codes = (await api.get("/api/provisioning/enrollment-codes")).json()["enrollment_codes"]
        assert [(c["name"], c["uses_left"]) for c in codes] == [("esp32-bridge simulate", 0)]
    simulate.send_signal(signal.SIGTERM)
    await asyncio.wait_for(simulate.wait(), 30)
    serve.send_signal(signal.SIGTERM)
    await asyncio.wait_for(serve.wait(), 30)
