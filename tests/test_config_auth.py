"""Settings precedence, token files, token matching and log redaction."""

import io
import json
import logging
import stat

import pytest
import structlog

from backend.auth import ensure_tokens, token_matches
from backend.config import ConfigError, load_settings
from backend.logs import configure_logging


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
        ("ws_port = 'abc'", "invalid setting 'ws_port'"),
        ("no_such_setting = 1", "invalid setting 'no_such_setting'"),
        ("ws_port = [", "cannot read config"),
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
