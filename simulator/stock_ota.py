"""The OTA check of a stock xiaozhi-esp32 device (protocol reference §5.1): its request headers
and system-info body, as the tests and the benchmarks send them to the bridge."""

from typing import Any

BOARD = "bread-compact-wifi"


def system_info(mac: str, client_id: str, version: str = "2.4.2") -> dict[str, Any]:
    """The §5.1 body: free heap as a string, and fields the bridge never uses (one unknown)."""
    return {
        "version": 2,
        "language": "en-US",
        "flash_size": 16777216,
        "minimum_free_heap_size": "158595",
        "mac_address": mac,
        "uuid": client_id,
        "chip_model_name": "esp32s3",
        "chip_info": {"model": 9, "cores": 2, "revision": 2, "features": 18},
        "application": {
            "name": "xiaozhi",
            "version": version,
            "compile_time": "Aug  8 2026T08:00:00Z",
            "idf_version": "v6.0.1",
            "elf_sha256": "ab" * 32,
        },
        "partition_table": [{"label": "nvs", "type": 1, "subtype": 2, "address": 36864}],
        "ota": {"label": "ota_0"},
        "display": {"monochrome": False, "width": 240, "height": 240},
        "board": {
            "type": BOARD,
            "name": BOARD,
            "ssid": "home",
            "rssi": -52,
            "channel": 6,
            "ip": "192.168.1.23",
            "mac": mac,
        },
        "future_field": {"kept": True},
    }


def stock_headers(
    mac: str, client_id: str | None, version: str = "2.4.2", serial: str | None = None
) -> dict[str, str]:
    """The §5.1 headers; Activation-Version 2 with a serial number (HMAC activation)."""
    headers = {
        "Activation-Version": "2" if serial else "1",
        "Device-Id": mac,
        "User-Agent": f"{BOARD}/{version}",
        "Accept-Language": "en-US",
        "Content-Type": "application/json",
    }
    if client_id is not None:
        headers["Client-Id"] = client_id
    if serial is not None:
        headers["Serial-Number"] = serial
    return headers
