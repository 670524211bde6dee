"""The OTA/activation exchange of stock xiaozhi-esp32 firmware (protocol reference §5), as data.

Requests: `OtaHeaders` (Device-Id, Client-Id, Activation-Version, Serial-Number, User-Agent,
Accept-Language) and the system-info body, read tolerantly by `summarize` (wrong types are
dropped rather than refused, `minimum_free_heap_size` is a string on stock firmware, unknown
fields are kept in `system_info`). Answers: the sections of §5.2, built here and nowhere else,
so the rules that keep stock firmware out of trouble live in one place:

- `firmware` never carries `force` and never a version the stock parser would choke on (it
  `stoi`s every dot-separated segment): without an upgrade it repeats the device's own version
  when that parses, and is left out otherwise; an upgrade is offered only for a strictly newer
  digits-only version.
- `websocket` or `mqtt`, never both (`mqtt` wins on the device when both are present).
- `activation` only while the device is not approved, and never together with credentials:
  an answer that keeps `activation` after approval loops the device forever.
"""

import re
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from backend.transports.mqtt_topics import TopicScheme, build_client_id, device_key

MAX_BODY_BYTES = 16384
_VERSION = re.compile(r"^\d{1,9}(\.\d{1,9}){0,3}$")
_TEXT_LIMIT = 128


class OtaHeaders(BaseModel):
    """The request headers of §5.1 (the transport layer found them; None when absent)."""

    model_config = ConfigDict(frozen=True)

    device_id: str
    client_id: str
    activation_version: str | None = None
    serial_number: str | None = Field(default=None, max_length=64)
    user_agent: str | None = None
    accept_language: str | None = None
    remote: str | None = None

    @property
    def ua_board(self) -> str | None:
        """The board type from `User-Agent: <board>/<version>`."""
        if not self.user_agent or "/" not in self.user_agent:
            return None
        return _text(self.user_agent.split("/", 1)[0].strip())

    @property
    def ua_version(self) -> str | None:
        """The firmware version from the User-Agent (`board/version ...`), if it has one."""
        if not self.user_agent or "/" not in self.user_agent:
            return None
        words = self.user_agent.split("/", 1)[1].split()
        return _text(words[0]) if words else None


def parse_version(text: object) -> tuple[int, ...] | None:
    """Dot-separated integers (what stock firmware compares), or None for anything else."""
    if not isinstance(text, str) or not _VERSION.match(text):
        return None
    return tuple(int(part) for part in text.split("."))


def valid_version(text: str) -> bool:
    """Whether the text is a version stock firmware can compare (dotted digits)."""
    return parse_version(text) is not None


def is_newer(candidate: str, current: str | None) -> bool:
    """Whether `candidate` is strictly newer than `current` (False when either cannot be
    compared: never offer an upgrade on a guess)."""
    new, old = parse_version(candidate), parse_version(current)
    if new is None or old is None:
        return False
    width = max(len(new), len(old))
    return new + (0,) * (width - len(new)) > old + (0,) * (width - len(old))


def summarize(body: dict[str, Any], headers: OtaHeaders) -> dict[str, Any]:
    """What the catalogue keeps of a device's system info: a few typed fields for listings, and
    the whole body (unknown fields included) as `system_info`."""
    application = _dict(body.get("application"))
    board = _dict(body.get("board"))
    chip_info = _dict(body.get("chip_info"))
    network: dict[str, Any] = {}
    for key in ("ssid", "rssi", "channel", "ip", "carrier", "csq"):
        value = board.get(key)
        if isinstance(value, str | int) and not isinstance(value, bool):
            network[key] = _text(value) if isinstance(value, str) else value
    if "carrier" in network or "csq" in network:
        network = {"type": "cellular", **network}
    elif "ssid" in network or "rssi" in network:
        network = {"type": "wifi", **network}
    summary: dict[str, Any] = {
        "board_type": _text(board.get("type")) or headers.ua_board,
        "board_name": _text(board.get("name")),
        "chip": _text(body.get("chip_model_name")),
        "chip_revision": _int(chip_info.get("revision")),
        "firmware_version": _text(application.get("version")) or headers.ua_version,
        "firmware_name": _text(application.get("name")),
        "elf_sha256": _text(application.get("elf_sha256")),
        "flash_size": _int(body.get("flash_size")),
        "minimum_free_heap_size": _int(body.get("minimum_free_heap_size")),
        "mac": _text(body.get("mac_address")),
        "language": _text(body.get("language")) or _text(headers.accept_language),
        "network": network or None,
        "activation_version": _text(headers.activation_version),
        "serial_number": headers.serial_number,
        "remote": headers.remote,
    }
    compact = {key: value for key, value in summary.items() if value is not None}
    compact["system_info"] = body
    return compact


# ---- answer sections -------------------------------------------------------------------------


def server_time(offset_min: int | None = None, now: float | None = None) -> dict[str, int]:
    """The `server_time` section: now in ms and the UTC offset in minutes (the host's by
    default)."""
    moment = time.time() if now is None else now
    if offset_min is None:
        local = time.localtime(moment).tm_gmtoff
        offset_min = int(local // 60)
    return {"timestamp": int(moment * 1000), "timezone_offset": offset_min}


def no_upgrade(current_version: str | None) -> dict[str, str] | None:
    """A `firmware` section that upgrades nothing (None: better leave the section out)."""
    if parse_version(current_version) is None:
        return None
    assert current_version is not None
    return {"version": current_version, "url": ""}


def upgrade(version: str, url: str, sha256: str, size: int) -> dict[str, Any]:
    """An upgrade offer; `sha256` and `size` are extra fields stock firmware ignores."""
    assert parse_version(version) is not None, "published versions are digits only"
    return {"version": version, "url": url, "sha256": sha256, "size": size}


def websocket_section(url: str, token: str, version: int = 1) -> dict[str, Any]:
    """The stock `websocket` section: URL, the device's token, protocol version."""
    return {"url": url, "token": token, "version": version}


@dataclass(frozen=True, slots=True)
class MqttAccess:
    """What a device is told about MQTT: the broker endpoint, topic prefix and keepalive; and
    `shards` (`mqtt_shards`): with more than one, its topics carry its shard."""

    endpoint: str
    topic_prefix: str
    keepalive_s: int = 240
    shards: int = 1


def mqtt_section(access: MqttAccess, device_id: str, client_id: str, token: str) -> dict[str, Any]:
    """The stock `mqtt` object (§2.1): username = device key, password = the device's token,
    publish_topic = its own uplink (the ACL lets it publish nowhere else), in its shard."""
    key = device_key(device_id)
    scheme = TopicScheme(access.topic_prefix, access.shards)
    return {
        "endpoint": access.endpoint,
        "client_id": build_client_id(device_id, client_id),
        "username": key,
        "password": token,
        "keepalive": access.keepalive_s,
        "publish_topic": scheme.up(key),
        "subscribe_topic": scheme.down(key),
    }


def activation_section(code: str, message: str, challenge: str) -> dict[str, Any]:
    """The stock `activation` section: the code shown to the user and the HMAC challenge."""
    return {"code": code, "message": message, "challenge": challenge, "timeout_ms": 30000}


# ---- helpers ---------------------------------------------------------------------------------


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: object) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    cleaned = "".join(char for char in value.strip() if char.isprintable())
    return cleaned[:_TEXT_LIMIT] or None


def _int(value: object) -> int | None:
    """An int, from an int or a decimal string (stock sends the free heap as a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 18:
        return int(value.strip())
    return None
