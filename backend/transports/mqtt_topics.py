"""The MQTT topic scheme of the bridge, and the stock client-id convention (reference §2.1).

Every device has three topics under a configurable prefix (default `xiaozhi`):

    <prefix>/<device>/up       the device publishes every JSON message here (its `publish_topic`)
    <prefix>/<device>/down     the bridge publishes here; the device reads it (own subscription,
                               or a server-side one for stock firmware that subscribes to nothing)
    <prefix>/<device>/status   presence: retained `online`, last will `offline` (or the embedded
                               broker's JSON event on behalf of a device that set no will)

With `mqtt_shards` = N > 1 (several bridge instances on one broker, docs/mqtt.md "Several bridge
instances") every device topic has one more level, its shard, before the key:

    <prefix>/s<shard>/<device>/up|down|status      shard = CRC-32 of the device key mod N

The shard level is `s` and the shard number in decimal without leading zeros (`s0` … `s1023`).
It sits at a fixed depth, so it can never be read as a key. Each bridge instance subscribes only
to the shards it owns (`TopicScheme.shard_filters`). A device may publish on any shard level for
its own key (a broker's ACL cannot compute the hash), so `parse` refuses a topic whose shard level
is not its key's: a device cannot appear on a second instance through another shard's topic.

`<device>` is the device key: the Device-Id with `_` for `:` (a MAC `a4:cf:12:34:56:78` becomes
`a4_cf_12_34_56_78`, as in the stock client id `GID_xxx@@@a4_cf_12_34_56_78@@@<uuid>`). A key is
one topic level of `[A-Za-z0-9_.-]`, so it can never carry a wildcard (`+`, `#`), a level
separator, a `$` system prefix or a NUL: a device cannot name another device's topic through its
key, and a broker ACL can confine it with one pattern line (`%u` or `${username}` = its key).
"""

import json
import re
import zlib
from dataclasses import dataclass
from enum import StrEnum

from backend.common import excerpt
from backend.transports.errors import TopicError, WrongShard

DEFAULT_PREFIX = "xiaozhi"
MAX_KEY_LENGTH = 64
_KEY = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_PREFIX_LEVEL = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_MAC_KEY = re.compile(r"^[0-9A-Fa-f]{2}(?:_[0-9A-Fa-f]{2}){5}$")
_MAC_ID = re.compile(r"^[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){5}$")
_CLIENT_GROUP = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_CLIENT_UUID = re.compile(r"^[A-Za-z0-9\-]{1,64}$")
_SHARD_LEVEL = re.compile(r"^s(0|[1-9][0-9]{0,3})$")
MAX_SHARDS = 1024
CLIENT_ID_SEPARATOR = "@@@"
ONLINE = "online"
OFFLINE = "offline"


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
    shard: int = 0

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


def validate_shard_count(shards: int) -> int:
    """`shards` if it is a shard count the scheme supports (1..MAX_SHARDS); TopicError otherwise."""
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise TopicError(f"shard count must be an integer from 1 to {MAX_SHARDS}, not {shards!r}")
    return shards


def shard_of(key: str, shards: int) -> int:
    """The shard of a device key: CRC-32 (IEEE, as zlib's) of its ASCII bytes, mod `shards`.

    Stable across processes, Python versions and languages (unlike `hash()`). A MAC-shaped key is
    hashed in lower case, as `device_id_from_key` reads it: its spellings are one device.
    """
    validate_shard_count(shards)
    canonical = key.lower() if _MAC_KEY.match(validate_device_key(key)) else key
    return zlib.crc32(canonical.encode("ascii")) % shards


def shard_level(shard: int) -> str:
    """The topic level of a shard number: `s7`."""
    return f"s{shard}"


def parse_shard_level(level: str) -> int:
    """The shard number of a level like `s7`; TopicError for anything else (`s07`, `7`, `s`)."""
    match = _SHARD_LEVEL.match(level)
    if match is None:
        raise TopicError(f"invalid shard level {excerpt(level)!r}")
    return int(match.group(1))


def validate_prefix(prefix: str) -> str:
    """A prefix of one or more plain levels (`xiaozhi`, `site1/xiaozhi`); TopicError otherwise."""
    if not isinstance(prefix, str) or not prefix:
        raise TopicError("topic prefix must not be empty")
    for level in prefix.split("/"):
        if not _PREFIX_LEVEL.match(level):
            raise TopicError(f"invalid topic prefix {excerpt(prefix)!r}")
    return prefix


class TopicScheme:
    """Builds and parses the per-device topics under one prefix, in `shards` shards (1: none)."""

    __slots__ = ("_levels", "prefix", "shards")

    def __init__(self, prefix: str = DEFAULT_PREFIX, shards: int = 1) -> None:
        self.prefix = validate_prefix(prefix)
        self.shards = validate_shard_count(shards)
        self._levels = prefix.count("/") + 1

    @property
    def sharded(self) -> bool:
        """Whether topics carry a shard level (more than one shard)."""
        return self.shards > 1

    def shard_of(self, key: str) -> int:
        """The shard a device key belongs to (always 0 without sharding)."""
        return shard_of(key, self.shards)

    def device_prefix(self, key: str) -> str:
        """What comes before a device's key in its topics: `<prefix>`, or `<prefix>/s<shard>`.

        Firmware that builds its topics from a prefix (`topic_prefix`) is given this one."""
        if not self.sharded:
            validate_device_key(key)
            return self.prefix
        return f"{self.prefix}/{shard_level(self.shard_of(key))}"

    def topic(self, key: str, kind: TopicKind) -> str:
        """`<prefix>[/s<shard>]/<key>/<kind>`; raises TopicError on an invalid device key."""
        return f"{self.device_prefix(key)}/{key}/{kind.value}"

    def up(self, key: str) -> str:
        """The topic the device publishes on."""
        return self.topic(key, TopicKind.UP)

    def down(self, key: str) -> str:
        """The topic the bridge publishes to the device on."""
        return self.topic(key, TopicKind.DOWN)

    def status(self, key: str) -> str:
        """The device's presence topic (retained online/offline)."""
        return self.topic(key, TopicKind.STATUS)

    def filter(self, kind: TopicKind, shard: int | None = None) -> str:
        """The subscription filter for one kind: across every device (`xiaozhi/+/up`, or
        `xiaozhi/+/+/up` when sharded), or across one shard's devices (`xiaozhi/s3/+/up`)."""
        if shard is None:
            middle = "+/+" if self.sharded else "+"
        elif self.sharded:
            middle = f"{shard_level(self._checked_shard(shard))}/+"
        else:
            self._checked_shard(shard)  # only shard 0 exists
            middle = "+"
        return f"{self.prefix}/{middle}/{kind.value}"

    def shard_filters(self, shard: int) -> list[str]:
        """What a bridge instance subscribes to for one shard it owns: uplinks, then presence."""
        return [self.filter(TopicKind.UP, shard), self.filter(TopicKind.STATUS, shard)]

    def _checked_shard(self, shard: int) -> int:
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < self.shards:
            raise TopicError(f"shard {shard!r} is not in 0..{self.shards - 1}")
        return shard

    @property
    def all_topics(self) -> str:
        """`<prefix>/#`: everything the bridge's own broker account may touch."""
        return f"{self.prefix}/#"

    def acl_topic(self, kind: TopicKind, username_placeholder: str) -> str:
        """A broker ACL line's topic for a device's own topic of `kind`, with the broker's
        placeholder for the login's username (`%u` on Mosquitto, `${username}` on EMQX).

        Sharded, the shard level is `+`: the broker cannot compute it, `parse` checks it."""
        middle = f"+/{username_placeholder}" if self.sharded else username_placeholder
        return f"{self.prefix}/{middle}/{kind.value}"

    def parse(self, topic: str) -> DeviceTopic:
        """The device, kind and shard of a concrete topic; TopicError for anything else, and
        WrongShard for a topic whose shard level is not its key's shard."""
        if not isinstance(topic, str):
            raise TopicError("topic must be a string")
        levels = topic.split("/")
        extra = 1 if self.sharded else 0
        if (
            len(levels) != self._levels + 2 + extra
            or "/".join(levels[: self._levels]) != self.prefix
        ):
            raise TopicError(f"not a device topic under {self.prefix!r}: {excerpt(topic)!r}")
        key, kind = levels[self._levels + extra], levels[self._levels + extra + 1]
        validate_device_key(key)
        try:
            parsed_kind = TopicKind(kind)
        except ValueError:
            raise TopicError(f"unknown topic kind {excerpt(kind)!r}") from None
        if not self.sharded:
            return DeviceTopic(key, parsed_kind)
        shard = parse_shard_level(levels[self._levels])
        expected = self.shard_of(key)
        if shard != expected:
            raise WrongShard(
                f"topic {excerpt(topic)!r} is in shard {shard}, its device key in {expected}"
            )
        return DeviceTopic(key, parsed_kind, shard)

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
