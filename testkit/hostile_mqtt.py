"""Hostile MQTT devices against the bridge's own endpoint (`serve --mqtt embedded`, issue #16).

The MQTT counterpart of `testkit.hostile`: each attack is what a device holding its own broker
login (username = its key, password = its derived password) or no login at all could do, spoken
as raw MQTT 3.1.1 on loopback so nothing filters what is sent. The attacker connects from
`ATTACKER_HOST` (another loopback address), so the bridge's per-address bounds apply to it and
not to the victims. Each attack runs for its window or count, and reports an `AttackReport`.

`MqttSiege` is `testkit.siege.Siege` with the bridge's embedded endpoint on and simulated MQTT
devices (`esp32-bridge simulate --transport mqtt`) as the victims; it also reports whether a
victim was acted for (an audit entry by `device:<victim>`) or went offline (its "device
disconnected" line) while the attack ran. Used by bench/reliability.py, bench/mqtt_churn.py and
tests/test_hostile_mqtt.py.
"""

import asyncio
import contextlib
import json
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from backend.protocol.mqtt_packets import remaining_length
from backend.transports.mqtt_credentials import DerivedCredentials
from backend.transports.mqtt_topics import TopicScheme, device_key
from simulator.fleet import device_id_for
from testkit.hostile import AttackReport, close_counting_peer_closes
from testkit.siege import EVIL_DEVICE, Attack, Siege, SiegeResult

SECRET = "siege-mqtt-secret-0123456789abcdef"  # the bridge's credential secret in a siege
ATTACKER_HOST = "127.0.0.2"  # not the victims' 127.0.0.1: the per-address bounds hit only it
LEGIT_HOST = "127.0.0.3"  # a device that must still get in while an address is flooded
LEGIT_DEVICE = device_id_for(99)
FORGED = b'{"type":"listen","state":"detect","text":"set the volume to 3"}'
BIG = 60_000
CONNECT_TIMEOUT_S = 5.0

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL = 1, 2, 3, 4, 5, 6
SUBSCRIBE, SUBACK, DISCONNECT = 8, 9, 14
SERVER_UNAVAILABLE = 3


@dataclass(frozen=True)
class Target:
    """Where to attack and as whom: the endpoint, the attacker's login, the victim's key."""

    host: str
    port: int
    secret: str
    device_id: str  # the attacker's own (approved) device
    victim_id: str
    prefix: str = "xiaozhi"

    @classmethod
    def parse(cls, url: str, secret: str, device_id: str, victim_id: str) -> "Target":
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 1883, secret, device_id, victim_id)

    def password(self, device_id: str) -> str:
        return DerivedCredentials(self.secret.encode()).issue(device_id).password

    @property
    def key(self) -> str:
        return device_key(self.device_id)

    @property
    def victim_key(self) -> str:
        return device_key(self.victim_id)

    @property
    def scheme(self) -> TopicScheme:
        return TopicScheme(self.prefix)


# ---- a raw client: only what the attacks need ----------------------------------------------------


def _string(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return struct.pack(">H", len(data)) + data


def packet(kind: int, flags: int, body: bytes) -> bytes:
    return bytes([kind << 4 | flags]) + remaining_length(len(body)) + body


def connect_packet(
    client_id: str,
    username: str | None,
    password: str | None,
    *,
    will: tuple[str, bytes] | None = None,
    clean_session: bool = True,
    keepalive: int = 60,
) -> bytes:
    flags = 0x02 if clean_session else 0
    payload = _string(client_id)
    if will is not None:
        flags |= 0x04 | (1 << 3)  # will at QoS 1, as a broker would publish it
        payload += _string(will[0]) + _string(will[1])
    if username is not None:
        flags |= 0x80
        payload += _string(username)
    if password is not None:
        flags |= 0x40
        payload += _string(password)
    body = _string("MQTT") + bytes([4, flags]) + struct.pack(">H", keepalive) + payload
    return packet(CONNECT, 0, body)


def publish_packet(
    topic: str, payload: bytes, *, qos: int = 0, packet_id: int = 1, retain: bool = False
) -> bytes:
    body = _string(topic) + (struct.pack(">H", packet_id) if qos else b"") + payload
    return packet(PUBLISH, (qos << 1) | int(retain), body)


def subscribe_packet(packet_id: int, topic: str) -> bytes:
    return packet(SUBSCRIBE, 0x02, struct.pack(">H", packet_id) + _string(topic) + b"\x01")


class Link:
    """One TCP connection that said CONNECT. `code` is the CONNACK return code, None when the
    bridge dropped the connection before answering (a per-address bound at accept)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.code: int | None = None
        self.session_present = False
        self.received: dict[int, int] = {}  # packet type -> count, read by `drain_task`
        self.closed = asyncio.Event()
        self._drain: asyncio.Task[None] | None = None

    async def read_packet(self) -> tuple[int, bytes]:
        first = (await self.reader.readexactly(1))[0]
        size, shift = 0, 0
        for _ in range(4):
            byte = (await self.reader.readexactly(1))[0]
            size |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        return first >> 4, await self.reader.readexactly(size)

    def read_in_background(self) -> None:
        """Read (and count) what the bridge sends, so its answers never back up."""
        self._drain = asyncio.create_task(self._read_all())

    async def _read_all(self) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                kind, _body = await self.read_packet()
                self.received[kind] = self.received.get(kind, 0) + 1
        self.closed.set()

    async def send(self, data: bytes) -> None:
        if self.closed.is_set() or self.writer.is_closing():
            raise ConnectionResetError("closed by the bridge")
        self.writer.write(data)
        await self.writer.drain()

    async def abort(self) -> None:
        """Drop TCP without DISCONNECT (a crash: what would make a broker publish the will)."""
        self.writer.transport.abort()
        await self._stop()

    async def disconnect(self) -> None:
        with contextlib.suppress(ConnectionError):
            if not self.writer.is_closing():
                self.writer.write(packet(DISCONNECT, 0, b""))
                await self.writer.drain()
        self.writer.close()
        await self._stop()

    async def _stop(self) -> None:
        if self._drain is not None:
            self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)
        self.closed.set()


async def open_link(
    target: Target,
    device_id: str | None = None,
    *,
    local_host: str = ATTACKER_HOST,
    will: tuple[str, bytes] | None = None,
    clean_session: bool = True,
    login: bool = True,
) -> Link:
    """TCP from `local_host`, then CONNECT with `device_id`'s login (the attacker's by default)
    and wait for the CONNACK. OSError if the connection itself failed."""
    device_id = device_id or target.device_id
    key = device_key(device_id)
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(target.host, target.port, local_addr=(local_host, 0)),
        CONNECT_TIMEOUT_S,
    )
    link = Link(reader, writer)
    password = target.password(device_id) if login else None
    data = connect_packet(
        key, key if login else None, password, will=will, clean_session=clean_session
    )
    try:
        await link.send(data)
        kind, body = await asyncio.wait_for(link.read_packet(), CONNECT_TIMEOUT_S)
        if kind == CONNACK and len(body) == 2:
            link.session_present = bool(body[0] & 1)
            link.code = body[1]
    except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
        link.code = None  # dropped (or never answered)
    if link.code != 0:
        await link.abort()
    return link


def _tally(report: AttackReport, link: Link) -> None:
    """Counts CONNACK outcomes in `report.detail["connacks"]` ("dropped" when none came)."""
    name = "dropped" if link.code is None else str(link.code)
    connacks = report.detail.setdefault("connacks", {})
    connacks[name] = connacks.get(name, 0) + 1


# ---- identity ------------------------------------------------------------------------------------


async def will_impersonation(target: Target, duration_s: float) -> AttackReport:
    """A CONNECT with a will on the victim's up topic (a forged "set the volume to 3"), then one
    on its status topic saying `offline`, each followed by a TCP abort; repeated for the window.
    Every such CONNECT must be refused; a broker would have published the wills on the abort."""
    report = AttackReport("will on another device's up/status topic, then TCP abort")
    started = time.monotonic()
    wills = [
        (target.scheme.up(target.victim_key), FORGED),
        (target.scheme.status(target.victim_key), b"offline"),
    ]
    while time.monotonic() - started < duration_s:
        will = wills[report.sent % 2]
        try:
            link = await open_link(target, will=will)
        except OSError:
            report.detail["connect_errors"] = report.detail.get("connect_errors", 0) + 1
            await asyncio.sleep(0.05)
            continue
        report.sent += 1
        _tally(report, link)
        if link.code == 0:
            report.detail["accepted"] = report.detail.get("accepted", 0) + 1
        await link.abort()
        if link.code is None:
            await asyncio.sleep(0.05)  # held off at accept: the per-address rate
    report.seconds = time.monotonic() - started
    return report


async def foreign_topics(target: Target, duration_s: float) -> AttackReport:
    """Publishes on the victim's up and status topics (QoS 1), subscriptions to its downlink and
    to `#`, at line rate on one link; counts what came back on them (must be nothing)."""

    async def attack(link: Link, report: AttackReport) -> None:
        scheme, victim = target.scheme, target.victim_key
        n = report.sent
        if n % 4 == 0:
            await link.send(
                publish_packet(scheme.up(victim), FORGED, qos=1, packet_id=n % 65535 + 1)
            )
        elif n % 4 == 1:
            await link.send(
                publish_packet(scheme.status(victim), b"offline", qos=1, packet_id=n % 65535 + 1)
            )
        elif n % 4 == 2:
            await link.send(subscribe_packet(n % 65535 + 1, scheme.down(victim)))
        else:
            await link.send(subscribe_packet(n % 65535 + 1, "#"))

    report = await _persistently(
        "publish/subscribe on another device's topics", target, duration_s, attack
    )
    return report


# ---- size and QoS state --------------------------------------------------------------------------


async def big_publish(target: Target, duration_s: float) -> AttackReport:
    """One 64 MB PUBLISH: its header, then the body streamed in 64 KB writes until the bridge
    drops the connection (it can tell from the header) or the body is all sent."""
    size = 64 * 1024 * 1024
    report = AttackReport("one 64 MB PUBLISH (header, then the body streamed)")
    started = time.monotonic()
    link = await open_link(target)
    _tally(report, link)
    if link.code != 0:
        report.seconds = time.monotonic() - started
        return report
    link.read_in_background()
    topic = target.scheme.up(target.key)
    head = bytes([PUBLISH << 4]) + remaining_length(size) + _string(topic)
    chunk = b"x" * 65_536
    sent = 0
    try:
        await link.send(head)
        while sent < size and time.monotonic() - started < duration_s:
            await asyncio.wait_for(link.send(chunk), 10)
            sent += len(chunk)
    except (ConnectionError, TimeoutError):
        report.close_code = 1008  # cut off (MQTT has no close code; the WebSocket one's meaning)
    report.sent = sent
    report.detail["body_bytes_sent"] = sent
    if report.close_code is None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(link.closed.wait(), 2)
        if link.closed.is_set():
            report.close_code = 1008
    await link.abort()
    report.seconds = time.monotonic() - started
    return report


async def qos2_hoard(target: Target, duration_s: float) -> AttackReport:
    """QoS 2 publishes on its own up topic, each with a new id, never released (no PUBREL)."""

    async def attack(link: Link, report: AttackReport) -> None:
        topic = target.scheme.up(target.key)
        await link.send(publish_packet(topic, b"{}", qos=2, packet_id=report.sent % 65535 + 1))

    return await _persistently("QoS 2 hoarding (no PUBREL)", target, duration_s, attack)


async def ack_spam(target: Target, duration_s: float) -> AttackReport:
    """PUBACK and PUBREL for packet ids the bridge never used, at line rate."""

    async def attack(link: Link, report: AttackReport) -> None:
        kind, flags = (PUBACK, 0) if report.sent % 2 == 0 else (PUBREL, 2)
        await link.send(packet(kind, flags, struct.pack(">H", report.sent % 65535 + 1)))

    return await _persistently("PUBACK/PUBREL spam, unknown ids", target, duration_s, attack)


async def qos2_reuse(target: Target, duration_s: float) -> AttackReport:
    """The same QoS 2 packet id over and over, never released (repeats before PUBREL)."""

    async def attack(link: Link, _report: AttackReport) -> None:
        topic = target.scheme.up(target.key)
        await link.send(publish_packet(topic, b'{"type":"x"}', qos=2, packet_id=7))

    return await _persistently("QoS 2 id reuse (one id, no PUBREL)", target, duration_s, attack)


async def retained_flood(target: Target, count: float) -> AttackReport:
    """`count` retained 60 KB messages, each on a topic of its own under the device's prefix
    (a broker keeps one per topic), at QoS 1; reconnecting when cut off, for at most 60 s."""
    total = int(count)
    payload = b'{"type":"x","pad":"' + b"r" * BIG + b'"}'

    async def attack(link: Link, report: AttackReport) -> None:
        if report.sent >= total:
            raise _Done
        topic = f"{target.prefix}/{target.key}/retained/{report.sent}"
        await link.send(
            publish_packet(topic, payload, qos=1, packet_id=report.sent % 65535 + 1, retain=True)
        )

    name = f"{total:,} retained 60 KB messages"
    return await _persistently(name, target, 60.0, attack)


# ---- connections ---------------------------------------------------------------------------------


async def session_churn(target: Target, count: float) -> AttackReport:
    """`count` logins with clean_session = 0 (only its own login can get in, so this is reconnect
    churn of one device), each subscribing to its downlink and dropping TCP; counts how many
    were taken and whether any CONNACK claimed a kept session. At most 60 s."""
    report = AttackReport(f"{int(count):,} persistent-session logins of one device")
    started = time.monotonic()
    present = 0
    while report.sent < int(count) and time.monotonic() - started < 60.0:
        try:
            link = await open_link(target, clean_session=False)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        report.sent += 1
        _tally(report, link)
        if link.code == 0:
            present += link.session_present
            with contextlib.suppress(ConnectionError):
                await link.send(subscribe_packet(1, target.scheme.down(target.key)))
        await link.abort()
        if link.code is None:
            await asyncio.sleep(0.05)  # held off at accept: the per-address rate
    report.detail["session_present"] = present
    report.seconds = time.monotonic() - started
    return report


async def same_login_storm(target: Target, count: float) -> AttackReport:
    """`count` CONNECTs with the attacker's login, all at once; the links are held open 2 s."""
    total = int(count)
    report = AttackReport(f"{total:,} parallel CONNECTs with one device's login")
    started = time.monotonic()

    async def one() -> Link | None:
        try:
            return await open_link(target)
        except OSError:
            return None

    links = await asyncio.gather(*(one() for _ in range(total)))
    for link in links:
        if link is None:
            report.detail["connect_errors"] = report.detail.get("connect_errors", 0) + 1
        else:
            _tally(report, link)
    await asyncio.sleep(2.0)
    accepted = [link for link in links if link is not None and link.code == 0]
    report.detail["still_open"] = sum(await asyncio.gather(*map(_still_open, accepted)))
    await asyncio.gather(*(link.abort() for link in links if link is not None))
    report.sent = total
    report.seconds = time.monotonic() - started
    return report


async def _still_open(link: Link) -> bool:
    """Whether the bridge still holds this link: a read sees neither the end nor an error."""
    try:
        async with asyncio.timeout(0.3):
            while True:
                if not await link.reader.read(65_536):
                    return False
    except TimeoutError:
        return True
    except (ConnectionError, asyncio.IncompleteReadError):
        return False


async def idle_sockets(target: Target, count: float, hold_s: float = 5.0) -> AttackReport:
    """`count` TCP connections from one address that never send a byte, held `hold_s`; while
    they are held, a legitimate device (another address) must still log in."""
    total = int(count)
    report = AttackReport(f"{total:,} idle sockets without credentials, one address")
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    opened: list[socket.socket] = []
    for _ in range(total):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((ATTACKER_HOST, 0))
            await asyncio.wait_for(loop.sock_connect(sock, (target.host, target.port)), 2)
        except (OSError, TimeoutError):
            sock.close()
            report.detail["connect_errors"] = report.detail.get("connect_errors", 0) + 1
            continue
        opened.append(sock)
    report.sent = len(opened)
    # A device that is not the attacker, from another address, logs in during the flood.
    began = time.monotonic()
    try:
        legit = await open_link(target, LEGIT_DEVICE, local_host=LEGIT_HOST)
        report.detail["legit_connack"] = legit.code
        report.detail["legit_login_ms"] = round((time.monotonic() - began) * 1000, 1)
        if legit.code == 0:
            await legit.disconnect()
    except OSError as exc:
        report.detail["legit_connack"] = f"connect failed: {exc}"
    await asyncio.sleep(max(0.0, hold_s - (time.monotonic() - started)))
    report.detail["closed_by_bridge"] = close_counting_peer_closes(opened)
    report.seconds = time.monotonic() - started
    return report


async def reconnect_loop(target: Target, duration_s: float) -> AttackReport:
    """Connect, CONNECT, DISCONNECT as fast as the bridge allows, for the window; refusals and
    drops are counted and the loop goes on at once."""
    report = AttackReport("clean reconnect loop, one login")
    started = time.monotonic()
    while time.monotonic() - started < duration_s:
        try:
            link = await open_link(target)
        except OSError:
            report.detail["connect_errors"] = report.detail.get("connect_errors", 0) + 1
            await asyncio.sleep(0.01)
            continue
        report.sent += 1
        _tally(report, link)
        if link.code == 0:
            await link.disconnect()
        else:
            await asyncio.sleep(0.01)  # refused or dropped: do not spin
    report.detail["connections"] = report.detail.get("connacks", {}).get("0", 0)
    report.seconds = time.monotonic() - started
    return report


async def control_victim_login(target: Target, duration_s: float) -> AttackReport:
    """Not an attack: the control that shows the victim checks can fail. It logs in with the
    victim's own login (which only the victim holds) and says the forged listen on the victim's
    up topic, which is what a will on that topic would have done; the victim's link is replaced
    (it goes offline) and the turn calls a tool as the victim."""
    report = AttackReport("control: the victim's own login says the forged listen")
    started = time.monotonic()
    link = await open_link(target, target.victim_id)
    _tally(report, link)
    if link.code == 0:
        link.read_in_background()
        await link.send(publish_packet(target.scheme.up(target.victim_key), FORGED, qos=1))
        report.sent = 1
        await asyncio.sleep(min(duration_s, 3.0))  # the turn runs; then the link is dropped
        await link.abort()
    report.seconds = time.monotonic() - started
    return report


# ---- a persistent attacker -----------------------------------------------------------------------


class _Done(Exception):
    """The attack sent all it meant to."""


Step = Callable[[Link, AttackReport], Awaitable[None]]
RETRY_S = 0.5  # as `testkit.hostile.RETRY_S`: how soon a cut-off attacker tries again


async def _persistently(name: str, target: Target, duration_s: float, step: Step) -> AttackReport:
    """Log in and call `step` as fast as the link takes it; cut off, log in again (every
    `RETRY_S` while refused) until the window is spent. `close_code` 1008 once it was cut off;
    `detail` counts links, refusals and what the bridge sent back."""
    report = AttackReport(name)
    started = time.monotonic()
    links = refused = 0
    received: dict[int, int] = {}
    done = False
    while not done and time.monotonic() - started < duration_s:
        try:
            link = await open_link(target)
        except OSError:
            link = None
        if link is None or link.code != 0:
            refused += 1
            if link is not None:
                _tally(report, link)
            await asyncio.sleep(RETRY_S)
            continue
        links += 1
        link.read_in_background()
        try:
            # A bridge that stops reading cannot hold this past the window (plus a grace).
            async with asyncio.timeout(duration_s - (time.monotonic() - started) + 5.0):
                while time.monotonic() - started < duration_s:
                    await step(link, report)
                    report.sent += 1
                    if report.sent % 64 == 0:
                        await asyncio.sleep(0)  # let the reader see answers and the close
        except _Done:
            done = True
        except (ConnectionError, TimeoutError):
            report.close_code = 1008
        for kind, number in link.received.items():
            received[kind] = received.get(kind, 0) + number
        await link.abort()
    report.detail.update(links=links, refused_handshakes=refused, received=received)
    report.seconds = time.monotonic() - started
    return report


Runner = Callable[[Target, float], Awaitable[AttackReport]]
ATTACKS: dict[str, Runner] = {
    "mqtt_will_impersonation": will_impersonation,
    "mqtt_foreign_topics": foreign_topics,
    "mqtt_big_publish": big_publish,
    "mqtt_qos2_hoard": qos2_hoard,
    "mqtt_ack_spam": ack_spam,
    "mqtt_qos2_reuse": qos2_reuse,
    "mqtt_retained_flood": retained_flood,  # amount: a count
    "mqtt_session_churn": session_churn,  # amount: a count
    "mqtt_same_login_storm": same_login_storm,  # amount: a count
    "mqtt_idle_sockets": idle_sockets,  # amount: a count
    "mqtt_reconnect_loop": reconnect_loop,
    "mqtt_control_victim_login": control_victim_login,  # a control for the tests, not an attack
}


async def run_attack(
    name: str, url: str, secret: str, device_id: str, victim_id: str, amount: float
) -> AttackReport:
    if name not in ATTACKS:
        raise ValueError(f"unknown MQTT attack {name!r}")
    return await ATTACKS[name](Target.parse(url, secret, device_id, victim_id), amount)


# ---- the siege: an embedded endpoint with simulated MQTT devices as victims ----------------------


@dataclass
class MqttSiegeResult(SiegeResult):
    victim_disconnects: int = 0  # "device disconnected" lines of a victim during the window
    # Lines of a listen or a turn in a victim's name, and audit entries by `device:<victim>`.
    acted_as_victim: int = 0
    victim_lines: list[str] = field(default_factory=list)

    @property
    def victim_affected(self) -> bool:
        return bool(self.victim_disconnects or self.acted_as_victim)


class MqttSiege(Siege):
    """`Siege` over MQTT: `serve --mqtt embedded` (loopback, shared-mode logins derived from
    `SECRET`) with `devices` simulated MQTT devices; attacks from `testkit.hostile_mqtt`."""

    def __init__(self, devices: int = 4, **options: Any) -> None:
        super().__init__(devices, **options)
        self.mqtt_url = ""

    _folder_prefix = "siege-mqtt-"

    def _bridge_env(self) -> dict[str, str]:
        return {
            "BRIDGE_MQTT_SECRET": SECRET,  # derived broker logins: any device id may log in
            "BRIDGE_MQTT_HOST": "127.0.0.1",
            "BRIDGE_UDP_HOST": "127.0.0.1",
            "BRIDGE_UDP_PORT": "0",
        }

    def _transport_args(self) -> list[str]:
        return ["--mqtt", "embedded", "--mqtt-port", "0"]

    def _started(self, runtime: dict[str, Any]) -> None:
        self.mqtt_url = runtime["endpoints"]["mqtt"]

    def _simulate_args(self, data_dir: Path) -> list[str]:
        return ["--transport", "mqtt", "--mqtt", self.mqtt_url, "--data-dir", str(data_dir)]

    @property
    def victims(self) -> list[str]:
        return [device_id_for(i) for i in range(1, self.devices + 1)]

    async def measure(
        self, attack: Attack | None, duration_s: float, *, settle_s: float = 1.0
    ) -> MqttSiegeResult:
        assert self.bridge is not None and self._api is not None
        first_line = len(self.bridge.lines)
        result = await super().measure(attack, duration_s, settle_s=settle_s)
        victims = set(self.victims)
        parsed = [(line, _entry(line)) for line in self.bridge.lines[first_line:]]
        mine = [(line, entry) for line, entry in parsed if _field(entry, "device_id") in victims]
        lines = [line for line, _ in mine]
        events = [_field(entry, "event") for _, entry in mine]
        disconnects = sum(event == "device disconnected" for event in events)
        # A victim never types: a listen or a turn in its name is someone speaking as it.
        acted = sum(event in SPOKE_AS for event in events)
        for victim in victims:
            page = await self._api.get(
                "/api/audit", params={"device_id": victim, "actor": f"device:{victim}"}
            )
            acted += len(page.json()["entries"])
        values = {name: getattr(result, name) for name in SiegeResult.__dataclass_fields__}
        return MqttSiegeResult(
            **values,
            victim_disconnects=disconnects,
            acted_as_victim=acted,
            victim_lines=[line[:300] for line in lines[:20]],
        )

    def _attack_argv(self, attack: Attack) -> list[str]:
        """Against the MQTT endpoint, the first victim named."""
        argv = [sys.executable, "-m", "testkit.hostile_mqtt", attack.name, self.mqtt_url]
        argv += [SECRET, attack.device_id, self.victims[0] if self.devices else LEGIT_DEVICE]
        return [*argv, str(attack.amount)]


SPOKE_AS = ("listen", "device turn")


def _field(entry: object, name: str) -> str | None:
    value = entry.get(name) if isinstance(entry, dict) else None
    return value if isinstance(value, str) else None


def _entry(line: str) -> object:
    try:
        return json.loads(line)
    except ValueError:
        return None


def mqtt_attack(name: str, amount: float) -> Attack:
    """An `Attack` for `MqttSiege`: by the approved device `EVIL_DEVICE`."""
    return Attack(name, amount, EVIL_DEVICE)


def main() -> None:
    """`python -m testkit.hostile_mqtt ATTACK MQTT_URL SECRET DEVICE_ID VICTIM_ID AMOUNT`: one
    attack in its own process, its report as one JSON line."""
    name, url, secret, device_id, victim_id, amount = sys.argv[1:7]
    report = asyncio.run(run_attack(name, url, secret, device_id, victim_id, float(amount)))
    print(json.dumps(asdict(report)), flush=True)


if __name__ == "__main__":
    main()
