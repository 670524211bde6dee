"""The device's config.json: read it and check it with the firmware's own check, so the tools
accept exactly the configs the device accepts, plus what a real board needs on the LAN."""

import json
from pathlib import Path
from typing import Any

from backend.firmware.errors import DeviceConfigError
from backend.firmware.source import firmware_entry, firmware_source

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "0.0.0.0", "::1", "[::1]"})


def default_device_config(firmware: Path | None = None) -> Path:
    """firmware/config.json; DeviceConfigError when it does not exist."""
    candidate = firmware_source(firmware) / "config.json"
    if not candidate.is_file():
        raise DeviceConfigError(
            f"no config: pass --config FILE or create {candidate} from config.example.json"
        )
    return candidate


def read_device_config(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; DeviceConfigError if it is missing, unreadable or not one."""
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise DeviceConfigError(f"config file {path} not found") from None
    except OSError as exc:
        raise DeviceConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise DeviceConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise DeviceConfigError(f"{path} must hold a JSON object")
    return config


def check_device_config(where: str, config: dict[str, Any]) -> None:
    """The firmware's check_config (main.py); DeviceConfigError `where: reason` if it refuses."""
    entry = firmware_entry()
    try:
        entry.check_config(config)
    except entry.ConfigError as exc:
        raise DeviceConfigError(f"{where}: {exc}") from None


def may_use_mqtt(device_config: dict[str, Any]) -> bool:
    """MQTT by its config, or possibly by the bridge's OTA answer (the operator's choice)."""
    return device_config.get("transport") == "mqtt" or bool(device_config.get("ota_url"))


def check_for_board(path: Path, config: dict[str, Any]) -> None:
    """What a board needs beyond the firmware's check: Wi-Fi unless the HAL is fake."""
    # main.py checks this only after boot, then idles: better to refuse before copying.
    if config.get("hal", "esp32") == "esp32" and not config.get("ssid"):
        raise DeviceConfigError(
            f'{path}: "ssid" is missing: the ESP32 needs Wi-Fi (or set "hal": "fake")'
        )


def board_warnings(path: Path, config: dict[str, Any]) -> list[str]:
    """Settings of a checked config that are valid but rarely what one wants on a board."""
    warnings = []
    if config.get("ota_url"):
        host, _port, _path = firmware_module_ota().parse_http_url(config["ota_url"])
        if host in LOOPBACK_HOSTS:
            warnings.append(
                f"{path}: ota_url host {host} is the board itself; use the bridge machine's "
                "LAN address"
            )
        return warnings
    mqtt = config.get("transport") == "mqtt"  # docs/mqtt.md: the broker login is its own
    if not config.get("token") and not mqtt:
        warnings.append(
            f'{path}: "token" is empty; a bridge with device auth (the default) answers 401: '
            'set "ota_url" instead so the board gets its own token'
        )
    host = mqtt_url_host(config["mqtt"]["url"]) if mqtt else url_host(config["url"])
    if host in LOOPBACK_HOSTS:
        warnings.append(
            f"{path}: url host {host} is the board itself; use the bridge machine's LAN address"
        )
    return warnings


def mqtt_url_host(url: str) -> str:
    """The host of an mqtt:// URL, parsed by the firmware's MQTT transport."""
    firmware_entry()  # puts firmware/lib on the path
    from transport_mqtt import parse_url  # type: ignore[import-not-found]

    host, _port = parse_url(url)[:2]
    return str(host)


def firmware_module_ota() -> Any:
    """The firmware's own ota module (its URL parser), loaded beside main.py."""
    entry = firmware_entry()
    return entry.ota


def url_host(url: str) -> str:
    """The host of a ws:// URL, parsed by the firmware's own parser (ValueError if invalid)."""
    host, _port, _path = firmware_entry().parse_url(url)
    return str(host)
