"""Settings precedence, token files (and where `serve` and the console's login say they are),
token matching and log redaction."""

import asyncio
import io
import json
import logging
import shlex
import signal
import socket
import stat
from pathlib import Path

import pytest
import structlog

from backend.auth import ensure_tokens, token_matches
from backend.config import ConfigError, load_settings
from backend.logs import configure_logging
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN
from tests.console_helpers import console_page
from tests.helpers import run_cli, start_cli


def test_defaults_are_secure(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    settings = load_settings()
    assert settings.http_host == "127.0.0.1"
    assert settings.device_auth == "device"  # per-device tokens from OTA activation
    assert settings.ws_port == 8000 and settings.ws_path == "/xiaozhi/v1/"
    assert settings.data_dir == tmp_path / "esp32-bridge"
    assert settings.timeout_for("self.camera.take_photo") == 30.0
    assert settings.timeout_for("self.reboot") == 10.0


def test_flags_beat_env_beat_toml(tmp_path, monkeypatch):
    config = tmp_path / "bridge.toml"
    config.write_text("ws_port = 9001\nhttp_port = 9002\ncall_timeout_s = 3.5\n")
    monkeypatch.setenv("BRIDGE_HTTP_PORT", "9102")
    settings = load_settings(config, ws_port=9201, http_port=None)
    assert settings.ws_port == 9201  # flag
    assert settings.http_port == 9102  # env beats file
    assert settings.call_timeout_s == 3.5  # file beats default


def test_config_file_from_env(tmp_path, monkeypatch):
    config = tmp_path / "b.toml"
    config.write_text('[tool_timeouts]\n"self.slow" = 42\n')
    monkeypatch.setenv("BRIDGE_CONFIG", str(config))
    assert load_settings().timeout_for("self.slow") == 42


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("ws_port = 'abc'", r"bad\.toml, line 1: invalid setting 'ws_port'"),
        ("no_such_setting = 1", r'bad\.toml, line 1: unknown setting "no_such_setting"'),
        ("ws_port = ]", r"cannot read config .*bad\.toml: .*line 1"),
    ],
)
def test_bad_config_gives_one_clear_line(tmp_path, content, message):
    config = tmp_path / "bad.toml"
    config.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_settings(config)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(tmp_path / "nope.toml")


def test_device_auth_modes_and_their_old_boolean_spelling(tmp_path, monkeypatch):
    assert load_settings(device_auth=True).device_auth == "device"
    assert load_settings(device_auth=False).device_auth == "off"
    monkeypatch.setenv("BRIDGE_DEVICE_AUTH", "false")
    assert load_settings().device_auth == "off"
    monkeypatch.setenv("BRIDGE_DEVICE_AUTH", "shared")
    assert load_settings().device_auth == "shared"
    monkeypatch.setenv("BRIDGE_DEVICE_AUTH", "nobody")
    with pytest.raises(ConfigError, match="device_auth"):
        load_settings()


def test_per_device_mode_creates_no_shared_device_token(tmp_path):
    tokens = ensure_tokens(load_settings(data_dir=tmp_path / "d"))
    assert tokens.device is None
    assert [path.name for path in tokens.created] == ["admin.token"]
    assert not (tmp_path / "d" / "device.token").exists()


def test_tokens_created_once_with_mode_0600(tmp_path):
    settings = load_settings(data_dir=tmp_path / "d", device_auth="shared")
    first = ensure_tokens(settings)
    assert len(first.created) == 2
    for path in first.created:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second = ensure_tokens(settings)
    assert second.created == []
    assert (second.admin, second.device) == (first.admin, first.device)
    assert first.admin != first.device and len(first.admin) >= 32


def test_configured_tokens_win_and_create_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("BRIDGE_ADMIN_TOKEN", "a" * 40)
    monkeypatch.setenv("BRIDGE_DEVICE_TOKEN", "d" * 40)
    tokens = ensure_tokens(load_settings(data_dir=tmp_path / "d"))
    assert (tokens.admin, tokens.device, tokens.created) == ("a" * 40, "d" * 40, [])
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("presented", "expected"),
    [
        ("Bearer s3cret", True),
        ("bearer s3cret", True),
        ("s3cret", True),
        ("Bearer  s3cret ", True),
        ("Bearer wrong", False),
        ("Basic s3cret", False),
        ("", False),
        (None, False),
    ],
)
def test_token_matching(presented, expected):
    assert token_matches(presented, "s3cret") is expected


def test_logs_mask_secret_fields(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging("info", "json")
    try:
        structlog.get_logger("t").info(
            "handshake",
            authorization="Bearer xyz123",
            device_token="q9",
            api_key="k7",
            first_token_ms=812.5,  # a timing, not a secret
            prompt_tokens=31,
        )
        logging.getLogger("plain").info("stdlib line")
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["authorization"] == "***" and lines[0]["device_token"] == "***"
    assert lines[0]["api_key"] == "***"
    assert "xyz123" not in stream.getvalue() and "q9" not in stream.getvalue()
    assert lines[0]["first_token_ms"] == 812.5 and lines[0]["prompt_tokens"] == 31
    assert lines[1]["event"] == "stdlib line"


# ---- where the admin token is: `serve` at every start, the console's login form ---------------


async def serve_until_ready(data_dir: Path, env: dict[str, str] | None = None) -> list[str]:
    """`serve` started, its stdout up to the ready line, then stopped (SIGTERM)."""
    process = await start_cli("serve", data_dir, env)
    assert process.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(60):
        while not lines or not lines[-1].startswith("bridge ready:"):
            line = (await process.stdout.readline()).decode()
            assert line, f"serve ended: {lines}, {(await process.communicate())[1].decode()}"
            lines.append(line.rstrip("\n"))
    process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0
    return lines


async def test_serve_names_the_admin_token_file_at_every_start(tmp_path):
    data_dir = tmp_path / "data"
    token_file = data_dir / "admin.token"
    said = f"admin token: in {token_file} (log in to the console with it)"
    first = await serve_until_ready(data_dir)
    assert f"created secret file {token_file} (mode 0600)" in first
    assert said in first
    second = await serve_until_ready(data_dir)
    assert not any(line.startswith("created secret file") for line in second)
    assert said in second
    token = token_file.read_text().strip()
    assert not any(token in line for line in first + second)
    given = "g" * 40  # a token given in the environment: said so, never printed
    third = await serve_until_ready(data_dir, {"BRIDGE_ADMIN_TOKEN": given})
    assert "admin token: the one given (BRIDGE_ADMIN_TOKEN or admin_token in the config file)" in (
        third
    )
    assert not any(given in line for line in third)


async def test_a_port_in_use_fails_before_any_secret_file_is_written(tmp_path):
    data_dir = tmp_path / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = await run_cli(
            "serve", "--data-dir", str(data_dir), "--ws-port", "0", "--device-http-port", "0",
            "--http-port", str(port),
        )  # fmt: skip
    assert code == 1, out + err
    (line,) = err.strip().splitlines()  # the error alone: no log line came before it
    assert line.startswith(f"error: cannot listen for the admin API on 127.0.0.1:{port}")
    assert "address already in use" in line and "--http-port" in line
    assert out == ""
    assert not (data_dir / "admin.token").exists()
    assert not (data_dir / "device-credentials.secret").exists()


async def test_the_login_form_says_where_the_admin_token_is_and_how_to_make_a_key(
    bridge: Bridge,
):
    async with console_page(bridge, "/", None) as console:
        page = console.page
        help_text = await page.locator("#api-key-help").inner_text()
        assert "admin.token" in help_text and "serve prints its path" in help_text
        assert "~/.local/share/esp32-bridge/admin.token" in help_text
        command = await page.locator("#api-key-command").inner_text()
        assert command in help_text

        # The command works as shown, and its key opens every page of the console.
        program, *args = shlex.split(command)
        assert program == "esp32-bridge"
        code, out, err = await run_cli(*args, "--server", bridge.api_url, "--token", ADMIN_TOKEN)
        assert code == 0, out + err
        key = next(word for word in out.split() if word.startswith("esk_"))
        await page.get_by_label("API key or admin token").fill(key)
        await page.get_by_role("button", name="Log in").click()
        nav = page.get_by_role("navigation", name="Console")
        await nav.wait_for()
        links = await nav.get_by_role("link").all_inner_texts()
        assert {"Chat", "Settings", "Devices", "Talk"} <= set(links), links
        console.assert_clean()
