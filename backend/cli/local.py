"""How commands find a bridge on this machine: settings, its runtime file, its token files."""

import os
from pathlib import Path
from typing import Any

from backend.auth import ADMIN_TOKEN_FILE, DEVICE_TOKEN_FILE, read_token
from backend.cli.output import fail
from backend.common import reachable_host, url_host
from backend.config import ConfigError, Settings, load_settings
from backend.runtime import RUNTIME_FILE, read_runtime_file


def cli_settings(config: Path | None = None, **overrides: Any) -> Settings:
    """The settings (file, environment, overrides); a config error exits with status 2."""
    try:
        return load_settings(config, **overrides)
    except ConfigError as exc:
        raise fail(str(exc), 2) from None


def device_url(settings: Settings) -> str:
    """The running bridge's device endpoint, else the configured one."""
    return _runtime_value(settings, "ws_url") or (
        f"ws://{url_host(reachable_host(settings.ws_host))}:{settings.ws_port}{settings.ws_path}"
    )


# How to point a command at another bridge, said when the one it tried does not answer.
POINT_ELSEWHERE = (
    "pass the data directory of the bridge you mean with --data-dir (or BRIDGE_DATA_DIR), "
    "or its admin API URL with --server (or BRIDGE_SERVER)"
)


def api_url_and_hint(settings: Settings, server: str | None = None) -> tuple[str, str]:
    """The admin API URL to use (`server`, BRIDGE_SERVER, the running bridge's runtime file,
    the configured address), and what to say when nothing answers there: where the URL came
    from and how to point at another bridge."""
    if server:
        return server, "is it running there? (from --server)"
    if os.environ.get("BRIDGE_SERVER"):
        return os.environ["BRIDGE_SERVER"], "is it running there? (from BRIDGE_SERVER)"
    found = _runtime_value(settings, "api_url")
    if found:
        runtime = settings.data_dir / RUNTIME_FILE
        return found, (
            f"{runtime} names it, but the bridge that wrote it has stopped; start "
            f"`esp32-bridge serve`, or {POINT_ELSEWHERE}"
        )
    configured = f"http://{url_host(reachable_host(settings.http_host))}:{settings.http_port}"
    return configured, (
        f"no bridge runs with data directory {settings.data_dir} (no {RUNTIME_FILE} there): "
        f"start `esp32-bridge serve`, or {POINT_ELSEWHERE}"
    )


def admin_token_source(settings: Settings) -> str:
    """Where `admin_token()` found the token, for a refusal that says what to check."""
    if _secret(settings.admin_token):
        return "BRIDGE_ADMIN_TOKEN (or admin_token in the config file)"
    return f"{settings.data_dir / ADMIN_TOKEN_FILE} (the admin token of that data directory)"


def device_endpoint(
    settings: Settings, url: str | None = None, token: str | None = None
) -> tuple[str, str | None]:
    """The device URL and token to use: the given ones, else the local bridge's (shared
    device token: `device_auth = "shared"`)."""
    url = url or device_url(settings)
    token = token or device_token(settings)
    if token is None and device_auth_mode(settings) != "off":
        raise fail(
            "no device token: pass --token or run `esp32-bridge serve` once to create "
            f"{settings.data_dir / DEVICE_TOKEN_FILE}"
        )
    return url, token


def device_auth_mode(settings: Settings) -> str:
    """How the local bridge checks devices: its runtime file says, else the settings."""
    return _runtime_value(settings, "device_auth") or settings.device_auth


# What `simulate` can be given instead of a local bridge; `firmware run-host` has its own.
SIMULATE_ALTERNATIVES = (
    "pass --ota URL (e.g. from `esp32-bridge devices enroll`), or --url and --token "
    '(a bridge with device_auth = "shared")'
)


def local_ota_url(settings: Settings, alternatives: str = SIMULATE_ALTERNATIVES) -> str:
    """The running local bridge's OTA endpoint; fails (exit 1) when none is running, naming
    the data directory and the command's `alternatives`."""
    url = _runtime_value(settings, "ota_url")
    if url is None:
        raise fail(
            f"no bridge running with data directory {settings.data_dir}: start `esp32-bridge "
            f"serve`, point at its data directory with --data-dir, or {alternatives}"
        )
    return url


def device_token(settings: Settings) -> str | None:
    """The shared device token: the setting, else the data-dir file, else None."""
    return _secret(settings.device_token) or read_token(settings.data_dir, DEVICE_TOKEN_FILE)


def admin_token(settings: Settings) -> str | None:
    """The admin token: the setting, else the data-dir file, else None."""
    return _secret(settings.admin_token) or read_token(settings.data_dir, ADMIN_TOKEN_FILE)


def _secret(value: Any) -> str | None:
    return value.get_secret_value() or None if value is not None else None


def _runtime_value(settings: Settings, key: str) -> str | None:
    value = (read_runtime_file(settings.data_dir) or {}).get(key)
    return value if isinstance(value, str) else None
