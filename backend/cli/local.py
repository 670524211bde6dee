"""How commands find a bridge on this machine: settings, its runtime file, its token files."""

import os
from pathlib import Path
from typing import Any

import typer

from backend.auth import ADMIN_TOKEN_FILE, DEVICE_TOKEN_FILE, read_token
from backend.cli.output import fail
from backend.common import reachable_host, url_host
from backend.config import ConfigError, Settings, load_settings
from backend.config_errors import warn_unknown_variables
from backend.runtime import LOCK_FILE, RUNTIME_FILE, read_runtime_file


def cli_settings(config: Path | None = None, **overrides: Any) -> Settings:
    """The settings (file, environment, overrides); a config error exits with status 2. A
    `BRIDGE_*` variable nothing reads (a typo) is warned about on stderr, once per process."""
    warn_unknown_variables(Settings, lambda line: typer.echo(f"warning: {line}", err=True))
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
    if read_token(settings.data_dir, ADMIN_TOKEN_FILE) is None:
        found = _running_bridge_token(settings.data_dir)
        if found is not None:
            return f"BRIDGE_ADMIN_TOKEN of the bridge of {settings.data_dir} (pid {found[1]})"
    return f"{settings.data_dir / ADMIN_TOKEN_FILE} (the admin token of that data directory)"


def no_admin_token(settings: Settings) -> str:
    """Why no admin token was found, and what to do: one line for the user."""
    pid = _lock_holder(settings.data_dir)
    if pid is not None:
        # `serve` writes admin.token unless it was given one: from its environment or config.
        return (
            f"no admin token: the bridge running with data directory {settings.data_dir} (pid "
            f"{pid}) was given its admin token (BRIDGE_ADMIN_TOKEN or admin_token in its config "
            "file) and this user cannot read its environment: pass --token, set "
            "BRIDGE_ADMIN_TOKEN, or pass its config file with --config"
        )
    return (
        f"no admin token: pass --token, set BRIDGE_ADMIN_TOKEN, or run `serve` once with "
        f"data directory {settings.data_dir} (--data-dir, BRIDGE_DATA_DIR)"
    )


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
    """The admin token: the setting, else the data-dir file, else the BRIDGE_ADMIN_TOKEN the
    bridge running with that data directory was started with, else None."""
    token = _secret(settings.admin_token) or read_token(settings.data_dir, ADMIN_TOKEN_FILE)
    if token is None and (found := _running_bridge_token(settings.data_dir)) is not None:
        token = found[0]
    return token


def _running_bridge_token(data_dir: Path) -> tuple[str, int] | None:
    """The BRIDGE_ADMIN_TOKEN in the environment of the bridge that holds `data_dir` now, and
    its pid; None when no bridge holds it, it was started without one, or this user may not
    read its environment. `serve` writes no admin.token when it is given the token, so this is
    how `--data-dir` finds it. Linux's /proc/PID/environ is readable only by the process's own
    user and root: the same people who could read an admin.token file of that directory (0600).
    The pid must hold the directory's lock now, so a stale bridge.json or a reused pid never
    points at another process."""
    pid = _lock_holder(data_dir)
    if pid is None:
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # not Linux, another user's process, or it just ended
        return None
    for entry in environ.split(b"\0"):
        name, _, value = entry.partition(b"=")
        if name.upper() == b"BRIDGE_ADMIN_TOKEN" and value.strip():
            return value.decode("utf-8", "replace").strip(), pid
    return None


def _lock_holder(data_dir: Path) -> int | None:
    """The pid of the live bridge holding `data_dir`'s lock (backend/runtime.py), or None. Read
    from Linux's /proc/locks, without taking the lock even for a moment (a `serve` starting
    then would find the directory busy); it must be the pid that bridge.json names."""
    try:
        inode = (data_dir / LOCK_FILE).lstat().st_ino
        locks = Path("/proc/locks").read_text()
    except OSError:
        return None
    named = (read_runtime_file(data_dir) or {}).get("pid")
    if not isinstance(named, int):
        return None
    for line in locks.splitlines():
        # "3: FLOCK  ADVISORY  WRITE 8485 08:01:1234 0 EOF" (a waiter's line has "->" first)
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or not fields[4].isdigit():
            continue
        if fields[5].rsplit(":", 1)[-1] == str(inode) and int(fields[4]) == named:
            return named
    return None


def _secret(value: Any) -> str | None:
    return value.get_secret_value() or None if value is not None else None


def _runtime_value(settings: Settings, key: str) -> str | None:
    value = (read_runtime_file(settings.data_dir) or {}).get(key)
    return value if isinstance(value, str) else None
