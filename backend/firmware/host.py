"""Run the firmware on this computer: firmware/main.py on the MicroPython unix port, fake HAL."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from backend.firmware.device_config import (
    check_device_config,
    may_use_mqtt,
    read_device_config,
)
from backend.firmware.errors import FirmwareExited
from backend.firmware.tools import micropython_env, stop_process

# (url or None, token or None) -> the config fields that reach the local bridge: {"url",
# "token"} (a bridge with a shared device token), or {"ota_url"} (per-device tokens: the
# firmware activates itself through the OTA endpoint).
LocalEndpoint = Callable[[str | None, str | None], dict[str, str]]


def host_client_id() -> str:
    """Stable per machine, so the bridge sees the same device on every run."""
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, f"run-host.{socket.gethostname()}"))


def host_config(
    config: Path | None,
    url: str | None,
    token: str | None,
    local_endpoint: LocalEndpoint,
) -> dict[str, Any]:
    """The device config for a host run: `config` (if given) with `url`/`token` over it; what is
    still missing comes from `local_endpoint` (a config with `ota_url` needs nothing more).
    "hal" is forced to "fake"; checked like deploy."""
    device = read_device_config(config) if config else {}
    if url:
        device["url"] = url
    if token:
        device["token"] = token
    mqtt = device.get("transport") == "mqtt"  # its broker and login are in config["mqtt"]
    needs_endpoint = not device.get("url") or not device.get("token")
    if not device.get("ota_url") and not mqtt and needs_endpoint:
        device.update(local_endpoint(device.get("url"), device.get("token")))
    device["hal"] = "fake"
    device.setdefault("client_id", host_client_id())
    check_device_config(str(config or "run-host"), device)
    return device


# firmware/main.py's exit status after it installed an OTA bundle (an ESP32 resets instead).
EXIT_UPDATED = 3
# Updates in a row before a host run gives up (each boot is offered a newer release).
MAX_UPDATES = 3


def run_on_host(
    micropython: str,
    firmware: Path,
    device_config: dict[str, Any],
    on_update: Callable[[str], None] = lambda _version: None,
) -> None:
    """`micropython main.py CONFIG` on a temporary copy of `firmware` until it ends or the user
    stops it (Ctrl-C, SIGTERM, SIGHUP: the firmware is stopped, no traceback). A bundle the
    bridge offers is installed into the copy, never into `firmware` (a source checkout), and
    the updated copy runs again, as an ESP32 reboots into it; `on_update` gets the version.
    FirmwareExited on a failure."""
    with tempfile.TemporaryDirectory(prefix="esp32-bridge-run-host-") as folder:
        config_file = Path(folder) / "config.json"
        config_file.write_text(json.dumps(device_config))
        copy = Path(folder) / "firmware"
        shutil.copytree(firmware, copy, ignore=shutil.ignore_patterns("__pycache__"))
        command = [micropython, str(copy / "main.py"), str(config_file)]
        libs = [copy / "lib"]
        if may_use_mqtt(device_config):  # umqtt.simple, in an ignored folder
            from backend.firmware import micropython_lib

            libs.append(micropython_lib.ensure())
        for _boot in range(MAX_UPDATES + 1):
            status = run_until_stopped(command, micropython_env(*libs))
            if status != EXIT_UPDATED:
                break
            on_update(_installed_version(copy))
        else:
            raise FirmwareExited(EXIT_UPDATED, f"updated {MAX_UPDATES + 1} times in a row")
    if status:
        raise FirmwareExited(status)


def _installed_version(firmware: Path) -> str:
    try:
        return (firmware / "version").read_text().strip() or "a new version"
    except OSError:
        return "a new version"


def run_until_stopped(command: list[str], env: dict[str, str]) -> int | None:
    """Exit status of the command, or None when the user stopped it (Ctrl-C, SIGTERM, SIGHUP)."""
    sys.stdout.flush()
    # Own session: Ctrl-C reaches only us, and we stop the firmware without its traceback.
    process = subprocess.Popen(command, env=env, start_new_session=True)
    previous = {
        sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        return process.wait()
    except KeyboardInterrupt:
        return None
    finally:
        stop_process(process)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_interrupt(_signum: int, _frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt
