"""Per-device broker credentials, and the ACL files of the brokers the bridge works with.

A device's broker username is its device key (`a4_cf_12_34_56_78`, see `mqtt_topics`), so one
pattern line per topic confines every device to its own topics: `%u` in Mosquitto's `acl_file`,
`${username}` in EMQX. Passwords are either derived (HMAC-SHA256 of a bridge secret and the key:
nothing to store, the bridge can hand a device its password again at any time) or random (held as
PBKDF2 hashes in a `CredentialTable`). The bridge itself has one account that may touch every
topic under the prefix.

Generated here, to be deployed next to an external broker:
- Mosquitto: `password_file` lines in `mosquitto_passwd`'s own format (`$7$`, PBKDF2-SHA512),
  written directly or by calling the tool, and an `acl_file`.
- EMQX: `acl.conf` authorization rules and the `auto_subscribe` block that gives a stock device
  (which subscribes to nothing) its downlink.
Mosquitto has no server-side subscription: stock firmware never gets a downlink through it.
"""

import base64
import hashlib
import hmac
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from backend.errors import BridgeError
from backend.transports.errors import CredentialError
from backend.transports.mqtt_topics import (
    DEFAULT_PREFIX,
    TopicKind,
    TopicScheme,
    device_key,
    validate_device_key,
)

MOSQUITTO_ITERATIONS = 101  # what mosquitto_passwd 2.0 writes
MOSQUITTO_SALT_BYTES = 12
_TABLE_ITERATIONS = 20_000
_PASSWORD_BYTES = 18  # 24 characters of URL-safe base64
# Fixed header (<= 5 bytes), topic name (a valid prefix and device key stay well under 1 KiB)
# and packet id, on top of the message itself.
PACKET_OVERHEAD_BYTES = 1024


@dataclass(frozen=True, slots=True)
class DeviceCredential:
    """What a device needs to log in to the broker (the OTA answer's `mqtt` username/password)."""

    device_id: str
    username: str
    password: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class BridgeAccount:
    """The bridge's own broker login: may publish and subscribe to everything under the prefix."""

    username: str = "bridge"
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)


class CredentialProvider(Protocol):
    """Checks a device login; the embedded endpoint asks it for every CONNECT of a device."""

    def verify(self, username: str, password: str) -> bool:
        """Whether this MQTT username (a device key) and password are valid."""


class DerivedCredentials:
    """Password = URL-safe base64 of HMAC-SHA256(secret, "mqtt-device:" + key), 32 characters.

    Nothing is stored per device: whoever holds the secret can issue and check any password.
    """

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise CredentialError("the credential secret must be at least 16 bytes")
        self._secret = secret

    def issue(self, device_id: str) -> DeviceCredential:
        """The device's MQTT credential, derived from the bridge's secret (nothing stored)."""
        key = device_key(device_id)
        return DeviceCredential(device_id, key, self._password(key))

    def verify(self, username: str, password: str) -> bool:
        """Check a derived password in constant time; a malformed username is just refused."""
        try:
            validate_device_key(username)
        except BridgeError:
            return False
        return hmac.compare_digest(self._password(username).encode(), password.encode())

    def _password(self, key: str) -> str:
        digest = hmac.new(self._secret, b"mqtt-device:" + key.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode()[:32]


class EitherCredentials:
    """A login is good when any of the providers accepts it (per-device tokens from
    provisioning, and the derived development passwords when the bridge allows those)."""

    def __init__(self, *providers: CredentialProvider) -> None:
        self._providers = providers

    def verify(self, username: str, password: str) -> bool:
        """Valid if any of the providers accepts it."""
        return any(provider.verify(username, password) for provider in self._providers)


class CredentialTable:
    """Random per-device passwords, kept only as salted PBKDF2-SHA256 hashes (in memory)."""

    def __init__(self) -> None:
        self._hashes: dict[str, tuple[bytes, bytes]] = {}

    def issue(self, device_id: str) -> DeviceCredential:
        """A new random password for the device (replaces any earlier one)."""
        key = device_key(device_id)
        password = secrets.token_urlsafe(_PASSWORD_BYTES)
        self.set(key, password)
        return DeviceCredential(device_id, key, password)

    def set(self, username: str, password: str) -> None:
        """Store a salted PBKDF2 hash of the password; raises on an invalid device key."""
        validate_device_key(username)
        salt = secrets.token_bytes(16)
        self._hashes[username] = (salt, _pbkdf2(password, salt))

    def revoke(self, device_id: str) -> None:
        """Forget the device's password; unknown devices are ignored."""
        self._hashes.pop(device_key(device_id), None)

    def verify(self, username: str, password: str) -> bool:
        """Check a password against its stored hash in constant time."""
        entry = self._hashes.get(username)
        if entry is None:
            return False
        salt, expected = entry
        return hmac.compare_digest(_pbkdf2(password, salt), expected)

    def __contains__(self, username: object) -> bool:
        return username in self._hashes


def _pbkdf2(password: str, salt: bytes) -> bytes:
    return hashlib.pbkdf2_hmac("sha256", password.encode(), salt, _TABLE_ITERATIONS)


# ---- Mosquitto ----------------------------------------------------------------------------------


def mosquitto_hash(
    password: str, salt: bytes | None = None, iterations: int = MOSQUITTO_ITERATIONS
) -> str:
    """A `password_file` hash as mosquitto_passwd 2.0 writes it: `$7$<iter>$<salt>$<hash>`."""
    salt = salt if salt is not None else secrets.token_bytes(MOSQUITTO_SALT_BYTES)
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    encoded_salt = base64.b64encode(salt).decode()
    return f"$7${iterations}${encoded_salt}${base64.b64encode(digest).decode()}"


def mosquitto_hash_matches(hashed: str, password: str) -> bool:
    """Check a password against a `$7$` (PBKDF2-SHA512) or `$6$` (salted SHA-512) hash."""
    parts = hashed.split("$")
    try:
        if len(parts) == 5 and parts[1] == "7":
            iterations, salt = int(parts[2]), base64.b64decode(parts[3])
            digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
        elif len(parts) == 4 and parts[1] == "6":
            salt = base64.b64decode(parts[2])
            digest = hashlib.sha512(password.encode() + salt).digest()
        else:
            return False
        return hmac.compare_digest(base64.b64encode(digest).decode(), parts[-1])
    except ValueError:
        return False


def _checked_login(username: str, password: str) -> None:
    if not username or any(char in username for char in ":\n\r\0"):
        raise CredentialError("a broker username may not be empty or hold ':' or line breaks")
    if any(char in password for char in "\n\r\0"):
        raise CredentialError("a broker password may not hold line breaks")


def mosquitto_password_file(logins: Iterable[tuple[str, str]]) -> str:
    """The text of a `password_file` for (username, password) pairs."""
    lines = []
    for username, password in logins:
        _checked_login(username, password)
        lines.append(f"{username}:{mosquitto_hash(password)}")
    return "\n".join(lines) + "\n"


def write_mosquitto_password_file(
    path: Path,
    logins: Iterable[tuple[str, str]],
    *,
    use_tool: bool = False,
    tool: str = "mosquitto_passwd",
) -> Path:
    """Write a `password_file` (mode 0600), hashing here or with `mosquitto_passwd -b`.

    With the tool, passwords travel on its command line (visible to local `ps` while it runs):
    prefer the in-process hashing on shared machines.
    """
    pairs = list(logins)
    for username, password in pairs:
        _checked_login(username, password)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not use_tool:
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(mosquitto_password_file(pairs))
        return path
    executable = shutil.which(tool)
    if executable is None:
        raise CredentialError(f"{tool} not found on PATH")
    with tempfile.TemporaryDirectory() as scratch:
        staged = Path(scratch) / "passwords"
        staged.touch(mode=0o600)
        for username, password in pairs:
            done = subprocess.run(
                [executable, "-b", str(staged), username, password],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise CredentialError(f"{tool} failed for {username!r}: {done.stderr.strip()}")
        path.write_bytes(staged.read_bytes())
    path.chmod(0o600)
    return path


def mosquitto_acl(
    prefix: str = DEFAULT_PREFIX,
    bridge_username: str = "bridge",
    *,
    more_bridge_usernames: Iterable[str] = (),
    shards: int = 1,
) -> str:
    """An `acl_file`: the bridge may do anything under the prefix; a device (username = its
    key) may publish only to its own uplink and status, and read only its own downlink.

    `more_bridge_usernames`: further accounts with the bridge's rights, one per additional bridge
    instance (with `mosquitto_conf()`'s `use_username_as_clientid`, two clients of one account
    replace each other's connection). `shards` > 1: the sharded topics, `<prefix>/+/%u/up` (the
    broker cannot compute a key's shard; the bridge refuses a topic in the wrong one)."""
    scheme = TopicScheme(prefix, shards)
    bridges = _bridge_usernames(bridge_username, more_bridge_usernames)
    lines = [
        "# Generated by esp32-mcp-bridge (backend/transports/mqtt_credentials.py).",
        "# Devices log in with username = device key (MAC with '_' for ':').",
    ]
    for username in bridges:
        lines += [f"user {username}", f"topic readwrite {scheme.all_topics}"]
    lines += [
        "",
        "# Every client, by its own username (%u).",
        f"pattern write {scheme.acl_topic(TopicKind.UP, '%u')}",
        f"pattern write {scheme.acl_topic(TopicKind.STATUS, '%u')}",
        f"pattern read {scheme.acl_topic(TopicKind.DOWN, '%u')}",
        "",
    ]
    return "\n".join(lines)


def _bridge_usernames(first: str, more: Iterable[str]) -> list[str]:
    usernames = [first, *more]
    for username in usernames:
        _checked_login(username, "")
    return list(dict.fromkeys(usernames))


@dataclass(frozen=True, slots=True)
class BrokerLimits:
    """The bounds an external broker is configured with (`mosquitto_conf`, `emqx_conf`).

    They bound what one login can make the broker hold: every device can be compromised, and a
    broker shares its memory, sockets and log between all of them.
    """

    # The largest message the bridge sends or accepts (`Settings.max_message_bytes`).
    max_message_bytes: int = 65536
    # Per listener; counts sockets that have not logged in yet (measured on Mosquitto 2.0.11).
    max_connections: int = 1000
    # EMQX only: new connections a second on the listener (Mosquitto has no such limit).
    max_conn_rate_per_s: int = 100
    # Stock firmware keeps alive every 240 s, ours every 60 s.
    max_keepalive_s: int = 300
    max_inflight: int = 20
    # Per client, above the in-flight ones; also the bridge's own subscription: size to the
    # fleet's bursts (a message over either bound is dropped silently).
    max_queued_messages: int = 1000
    max_queued_bytes: int = 4 * 1024 * 1024
    # A persistent session (clean session 0) left behind expires after this (Mosquitto counts
    # in hours).
    session_expiry_h: int = 1
    # True by default: our firmware sets a retained will and publishes a retained `online`, and
    # Mosquitto with `retain_available false` drops such a client (measured). The ACL bounds the
    # store to one message per topic a login may write: two per device.
    retain_available: bool = True
    # Connect/disconnect lines: 3 per connection on Mosquitto's defaults, unbounded under churn.
    log_connections: bool = False

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1024 or self.max_connections < 1 or self.session_expiry_h < 1:
            raise CredentialError("broker limits: message >= 1024 bytes, >= 1 connection, >= 1 h")
        if self.max_keepalive_s < 10:
            raise CredentialError("broker limits: max_keepalive_s below 10 s")

    @property
    def max_packet_bytes(self) -> int:
        """A whole MQTT packet carrying the largest message."""
        return self.max_message_bytes + PACKET_OVERHEAD_BYTES


def mosquitto_conf(
    *,
    port: int,
    password_file: Path,
    acl_file: Path,
    bind_address: str = "127.0.0.1",
    persistence: bool = False,
    run_as: str | None = None,
    limits: BrokerLimits | None = None,
) -> str:
    """A `mosquitto.conf` (2.0) for one listener with the files above, no anonymous login, and
    the bounds of `limits` (docs/mqtt.md, "Mosquitto and EMQX files", says what each stops).

    Every client's id is its username (`use_username_as_clientid`): the ACL confines a device
    by `%u` only, and Mosquitto disconnects the older connection of a client id that connects
    again, so a device naming another's client id would knock that one offline. A device can
    now replace only its own connection, and holds at most one session. The same holds for the
    bridge's account: each bridge instance needs an account of its own.

    `run_as`: the `user` Mosquitto switches to when started as root (default `mosquitto`, which
    may not be able to read files that only their owner can read).
    """
    bounds = limits or BrokerLimits()
    lines = [
        "# Generated by esp32-mcp-bridge (backend/transports/mqtt_credentials.py).",
        f"persistence {_flag(persistence)}",
        # Without it Mosquitto's Nagle holds a reply behind its own unacknowledged PUBACK to the
        # same client until that client's delayed ACK (~40 ms on Linux): every MCP round trip.
        "set_tcp_nodelay true",
        # A larger packet closes the connection as soon as its header is read: nothing buffered.
        f"max_packet_size {bounds.max_packet_bytes}",
        f"message_size_limit {bounds.max_message_bytes}",
        f"max_inflight_messages {bounds.max_inflight}",
        f"max_queued_messages {bounds.max_queued_messages}",
        f"max_queued_bytes {bounds.max_queued_bytes}",
        "queue_qos0_messages false",
        # Clean session 0 cannot be refused; with one client id per login there is one session
        # per account, dropped after this long away (and on restart, without persistence).
        f"persistent_client_expiration {bounds.session_expiry_h}h",
        # MQTT v5 clients only (2.0.11 lets a v3.1.1 client keep any keepalive, 0 included).
        f"max_keepalive {bounds.max_keepalive_s}",
        f"retain_available {_flag(bounds.retain_available)}",
        # Only what an operator must act on: no line per connection, login failure or dropped
        # packet, which a client could otherwise turn into unbounded log volume.
        "log_type error",
        "log_type warning",
        "log_type notice",
        f"connection_messages {_flag(bounds.log_connections)}",
    ]
    if bounds.log_connections:
        lines.append("log_type information")
    if run_as is not None:
        lines.append(f"user {run_as}")
    lines += [
        "",
        f"listener {port} {bind_address}",
        "allow_anonymous false",
        f"password_file {password_file}",
        f"acl_file {acl_file}",
        # The client id a CONNECT names is ignored: a device can only ever replace itself.
        "use_username_as_clientid true",
        # Counts sockets before login: a firewall must limit them per address (docs/mqtt.md).
        f"max_connections {bounds.max_connections}",
        # Nothing of ours uses QoS 2; a QoS 2 PUBLISH or will closes the connection, so no
        # client can hold messages in the broker by never sending PUBREL.
        "max_qos 1",
    ]
    return "\n".join(lines) + "\n"


def _flag(value: bool) -> str:
    return "true" if value else "false"


# ---- EMQX ---------------------------------------------------------------------------------------


def emqx_acl(
    prefix: str = DEFAULT_PREFIX,
    bridge_username: str = "bridge",
    *,
    more_bridge_usernames: Iterable[str] = (),
    shards: int = 1,
) -> str:
    """EMQX 5 file authorization (`acl.conf`, Erlang terms) with the same rules as above."""
    scheme = TopicScheme(prefix, shards)
    bridges = _bridge_usernames(bridge_username, more_bridge_usernames)
    up, status, down = (
        scheme.acl_topic(kind, "${username}")
        for kind in (TopicKind.UP, TopicKind.STATUS, TopicKind.DOWN)
    )
    return "\n".join(
        (
            "%% Generated by esp32-mcp-bridge (backend/transports/mqtt_credentials.py).",
            "%% EMQX authorizes a last will as a publish: a will on another device's topic",
            "%% falls through to the final deny and is never published.",
            *(
                f'{{allow, {{username, "{username}"}}, all, ["{scheme.all_topics}"]}}.'
                for username in bridges
            ),
            f'{{allow, all, publish, ["{up}", "{status}"]}}.',
            f'{{allow, all, subscribe, ["{down}"]}}.',
            "{deny, all}.",
            "",
        )
    )


def emqx_auto_subscribe(prefix: str = DEFAULT_PREFIX, qos: int = 1, shards: int = 1) -> str:
    """The EMQX 5 `auto_subscribe` block (HOCON): each device is subscribed to its own
    downlink when it connects, which is what stock firmware (subscribing to nothing) needs.
    Sharded, the filter has `+` for the shard level (EMQX cannot compute it): only the bridge
    publishes on a device's downlink, and only in its own shard."""
    scheme = TopicScheme(prefix, shards)
    topic = scheme.acl_topic(TopicKind.DOWN, "${username}")
    return "\n".join(
        (
            "auto_subscribe {",
            "  topics = [",
            f'    {{ topic = "{topic}", qos = {qos} }}',
            "  ]",
            "}",
            "",
        )
    )


def emqx_conf(limits: BrokerLimits | None = None, *, listener: str = "tcp.default") -> str:
    """EMQX 5 settings (HOCON, for `emqx.conf` or `base.hocon`) with the bounds of `limits`.

    Written from EMQX's configuration documentation; no EMQX runs in this project's tests.
    """
    bounds = limits or BrokerLimits()
    return "\n".join(
        (
            "# Generated by esp32-mcp-bridge (backend/transports/mqtt_credentials.py).",
            "mqtt {",
            # One session and one connection per login, as on Mosquitto.
            "  use_username_as_clientid = true",
            f'  max_packet_size = "{-(-bounds.max_packet_bytes // 1024)}KB"',
            "  max_qos_allowed = 1",
            f"  retain_available = {_flag(bounds.retain_available)}",
            f'  session_expiry_interval = "{bounds.session_expiry_h}h"',
            f"  max_inflight = {bounds.max_inflight}",
            f"  max_mqueue_len = {bounds.max_queued_messages}",
            "  mqueue_store_qos0 = false",
            "  max_awaiting_rel = 10",
            f"  server_keepalive = {bounds.max_keepalive_s}",
            # A socket that sends no CONNECT is closed after this.
            '  idle_timeout = "15s"',
            "}",
            "authorization {",
            "  no_match = deny",
            "  deny_action = disconnect",
            "}",
            # A login that reconnects more than 15 times a minute is banned for 5 minutes; EMQX
            # bans by client id, which use_username_as_clientid makes the login.
            "flapping_detect {",
            "  enable = true",
            "  max_count = 15",
            '  window_time = "1m"',
            '  ban_time = "5m"',
            "}",
            f"listeners.{listener} {{",
            f"  max_connections = {bounds.max_connections}",
            f'  max_conn_rate = "{bounds.max_conn_rate_per_s}/s"',
            "}",
            "",
        )
    )
