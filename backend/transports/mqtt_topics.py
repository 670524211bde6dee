"""The MQTT topic scheme of the bridge, and the stock client-id convention (reference §2.1).

Every device has three topics under a configurable prefix (default `xiaozhi`):

    <prefix>/<device>/up       the device publishes every JSON message here (its `publish_topic`)
    <prefix>/<device>/down     the bridge publishes here; the device reads it (own subscription,
                               or a server-side one for stock firmware that subscribes to nothing)
    <prefix>/<device>/status   presence: retained `online`, last will `offline` (or the embedded
                               broker's JSON event on behalf of a device that set no will)

`<device>` is the device key: the Device-Id with `_` for `:` (a MAC `a4:cf:12:34:56:78` becomes
`a4_cf_12_34_56_78`, as in the stock client id `GID_xxx@@@a4_cf_12_34_56_78@@@<uuid>`). A key is
one topic level of `[A-Za-z0-9_.-]`, so it can never carry a wildcard (`+`, `#`), a level
separator, a `$` system prefix or a NUL: a device cannot name another device's topic through its
key, and a broker ACL can confine it with one pattern line (`%u` or `${username}` = its key).
"""

import json
import re
from dataclasses import dataclass
from enum import StrEnum

from backend.common import excerpt
from backend.errors import BridgeError

DEFAULT_PREFIX = "xiaozhi"
MAX_KEY_LENGTH = 64
_KEY = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_PREFIX_LEVEL = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_MAC_KEY = re.compile(r"^[0-9A-Fa-f]{2}(?:_[0-9A-Fa-f]{2}){5}$")
_MAC_ID = re.compile(r"^[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5}$")
_CLIENT_GROUP = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_CLIENT_UUID = re.compile(r"^[A-Za-z0-9\-]{1,64}$")
CLIENT_ID_SEPARATOR = "@@@"
ONLINE = "online"
OFFLINE = "offline"


class TopicError(BridgeError):
    """A topic, prefix, device key or client id that the scheme does not accept."""


class TopicKind(StrEnum):
    """The last segment of a device topic: `up` from the device, `down` to it, `status`."""

    UP = "up"
    DOWN = "down"
    STATUS = "status"


@dataclass(frozen=True, slots=True)
class DeviceTopic:
    """A parsed device topic: whose it is and which of the three."""

    device_key: str
    kind: TopicKind

    @property
    def device_id(self) -> str:
        """The device id encoded in the topic's device key."""
        return device_id_from_key(self.device_key)


def validate_device_key(key: str) -> str:
    """`key` if it is a single safe topic level; TopicError otherwise."""
    if not isinstance(key, str) or not _KEY.match(key):
        raise TopicError(f"invalid device key {excerpt(key)!r}")
    return key


def device_key(device_id: str) -> str:
    """The topic level of a Device-Id: a MAC in lower case with `_` for `:`, else the id as is.

    Ids with `:` that are not MACs have no unambiguous key and are refused.
    """
    if not isinstance(device_id, str):
        raise TopicError("device id must be a string")
    if _MAC_ID.match(device_id):
        return device_id.lower().replace(":", "_")
    if ":" in device_id:
        raise TopicError(f"device id {excerpt(device_id)!r} has ':' but is not a MAC address")
    return validate_device_key(device_id)


def device_id_from_key(key: str) -> str:
    """The Device-Id of a key: MAC-shaped keys are MACs (`a4:cf:…`, lower case), others as is."""
    validate_device_key(key)
    if _MAC_KEY.match(key):
        return key.lower().replace("_", ":")
    return key


def validate_prefix(prefix: str) -> str:
    """A prefix of one or more plain levels (`xiaozhi`, `site1/xiaozhi`); TopicError otherwise."""
    if not isinstance(prefix, str) or not prefix:
        raise TopicError("topic prefix must not be empty")
    for level in prefix.split("/"):
        if not _PREFIX_LEVEL.match(level):
            raise TopicError(f"invalid topic prefix {excerpt(prefix)!r}")
    return prefix


class TopicScheme:
    """Builds and parses the per-device topics under one prefix."""

    __slots__ = ("_levels", "prefix")

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = validate_prefix(prefix)
        self._levels = prefix.count("/") + 1

    def topic(self, key: str, kind: TopicKind) -> str:
        """`<prefix>/<key>/<kind>`; raises TopicError on an invalid device key."""
        return f"{self.prefix}/{validate_device_key(key)}/{kind.value}"

    def up(self, key: str) -> str:
        """The topic the device publishes on."""
        return self.topic(key, TopicKind.UP)

    def down(self, key: str) -> str:
        """The topic the bridge publishes to the device on."""
        return self.topic(key, TopicKind.DOWN)

    def status(self, key: str) -> str:
        """The device's presence topic (retained online/offline)."""
        return self.topic(key, TopicKind.STATUS)

    def filter(self, kind: TopicKind) -> str:
        """The subscription filter for one kind across all devices, e.g. `xiaozhi/+/up`."""
        return f"{self.prefix}/+/{kind.value}"

    @property
    def all_topics(self) -> str:
        """`<prefix>/#`: everything the bridge's own broker account may touch."""
        return f"{self.prefix}/#"

    def parse(self, topic: str) -> DeviceTopic:
        """The device and kind of a concrete topic; TopicError for anything else."""
        if not isinstance(topic, str):
            raise TopicError("topic must be a string")
        levels = topic.split("/")
        if len(levels) != self._levels + 2 or "/".join(levels[: self._levels]) != self.prefix:
            raise TopicError(f"not a device topic under {self.prefix!r}: {excerpt(topic)!r}")
        key, kind = levels[self._levels], levels[self._levels + 1]
        validate_device_key(key)
        try:
            return DeviceTopic(key, TopicKind(kind))
        except ValueError:
            raise TopicError(f"unknown topic kind {excerpt(kind)!r}") from None

    def is_own(self, key: str, topic: str, *kinds: TopicKind) -> bool:
        """True when `topic` is exactly one of `kinds` of device `key` (no wildcards, no others)."""
        try:
            parsed = self.parse(topic)
        except TopicError:
            return False
        return parsed.device_key == key and parsed.kind in kinds


# ---- stock client id ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StockClientId:
    """`GID_xxx@@@a4_cf_12_34_56_78@@@<uuid>`: group, device key (MAC with `_`), client uuid."""

    group: str
    device_key: str
    client_id: str

    @property
    def device_id(self) -> str:
        """The device id encoded in the client id's device key."""
        return device_id_from_key(self.device_key)

    def __str__(self) -> str:
        return CLIENT_ID_SEPARATOR.join((self.group, self.device_key, self.client_id))


def is_stock_client_id(mqtt_client_id: str) -> bool:
    """Whether an MQTT client id has the stock firmware's `GID@@@KEY` shape."""
    return isinstance(mqtt_client_id, str) and CLIENT_ID_SEPARATOR in mqtt_client_id


def parse_client_id(mqtt_client_id: str) -> StockClientId:
    """Split a client id of the stock convention; TopicError if it does not follow it."""
    if not is_stock_client_id(mqtt_client_id):
        raise TopicError(f"client id {excerpt(mqtt_client_id)!r} is not GID@@@device@@@uuid")
    parts = mqtt_client_id.split(CLIENT_ID_SEPARATOR)
    if len(parts) != 3:
        raise TopicError(f"client id {excerpt(mqtt_client_id)!r} is not GID@@@device@@@uuid")
    group, key, uuid = parts
    if not _CLIENT_GROUP.match(group):
        raise TopicError(f"invalid group in client id {excerpt(mqtt_client_id)!r}")
    if not _CLIENT_UUID.match(uuid):
        raise TopicError(f"invalid client uuid in client id {excerpt(mqtt_client_id)!r}")
    return StockClientId(group, validate_device_key(key), uuid)


def build_client_id(device_id: str, client_uuid: str, group: str = "GID_xiaozhi") -> str:
    """The stock convention's client id for a device, as an OTA answer would hand it out."""
    if not _CLIENT_GROUP.match(group):
        raise TopicError(f"invalid client id group {excerpt(group)!r}")
    if not _CLIENT_UUID.match(client_uuid):
        raise TopicError(f"invalid client uuid {excerpt(client_uuid)!r}")
    return str(StockClientId(group, device_key(device_id), client_uuid))


# ---- presence payloads --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Presence:
    """One status message: `online`/`offline`, or the JSON event `{"state": …, "client_id": …}`."""

    online: bool
    client_id: str | None = None

    def encode(self) -> bytes:
        """The status payload: bare `online`/`offline`, or JSON with the client id."""
        state = ONLINE if self.online else OFFLINE
        if self.client_id is None:
            return state.encode()
        return json.dumps({"state": state, "client_id": self.client_id}).encode()


def parse_presence(payload: bytes) -> Presence:
    """Decode a status payload; TopicError for anything else (the empty retained-clear too)."""
    text = payload.decode("utf-8", errors="replace").strip()
    if text == ONLINE:
        return Presence(True)
    if text == OFFLINE:
        return Presence(False)
    if text.startswith("{"):
        try:
            event = json.loads(text)
        except ValueError:
            event = None
        if isinstance(event, dict) and event.get("state") in (ONLINE, OFFLINE):
            client_id = event.get("client_id")
            if client_id is not None and not (
                isinstance(client_id, str) and _CLIENT_UUID.match(client_id)
            ):
                client_id = None
            return Presence(event["state"] == ONLINE, client_id)
    raise TopicError(f"unknown presence payload {excerpt(text)!r}")


def claimed_device_id(text: str) -> object | None:
    """The `device_id` a JSON message claims, if any (None for unparsable text: the session
    decides what to do with that). The transports compare it with the sender they know."""
    if '"device_id"' not in text:
        return None
    try:
        message = json.loads(text)
    except ValueError:
        return None
    return message.get("device_id") if isinstance(message, dict) else None


def claims_another_device(text: str, device_id: str) -> bool:
    """True when `text` names a `device_id` that is not `device_id` (MAC spellings with `_`
    or in upper case are the same device)."""
    claimed = claimed_device_id(text)
    if claimed is None:
        return False
    if not isinstance(claimed, str):
        return True
    normalized = claimed.strip().lower() if ":" in claimed else claimed.strip()
    return normalized != device_id and normalized.replace("_", ":") != device_id
