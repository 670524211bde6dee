"""The UDP audio channel of the MQTT transport (protocol reference §2.2-2.3).

Packet (both directions), all integers big-endian:

    0 u8 type = 0x01 | 1 u8 flags | 2 u16 payload_len | 4 u32 ssrc | 8 u32 timestamp
    12 u32 sequence | 16 AES-128-CTR ciphertext of one Opus packet (payload_len bytes)

The 16-byte header is the initial counter block of AES-128-CTR. The device builds its uplink
header from the server's `nonce` with bytes 2-3, 8-11 and 12-15 overwritten, so bytes 0-1 and 4-7
are the nonce's: byte 0 is `0x01` and bytes 4-7 carry a per-session cookie, which is how one
socket tells the sessions apart. There is no authentication tag: the structural checks (length,
type, cookie, sequence) run before anything is decrypted, and a datagram that fails one is
dropped and counted, never raised.

Without a tag, a forged datagram with a live cookie decrypts to noise. What keeps a stranger who
knows (or guessed) a cookie from steering a session:

- the first peer is the source of a first uplink with a sequence near 1; it stays unconfirmed
  (and limited to a device's frame rate) until it has sent a run of well-formed Opus packets
  with one TOC byte, and another address with such a run takes it over at once;
- a confirmed peer (where the downlink goes) moves only after `move_confirmations` consecutive
  packets from the new address whose sequence is ahead and whose decrypted payload is a
  well-formed Opus packet (RFC 6716 §3.4) with a TOC byte the device's own stream has used, with
  no valid packet from the current peer in between, and at most once per `move_interval_s`;
  until then the old peer keeps the downlink and nothing from the new address is delivered;
- only packets from the current peer advance the session's sequence or reach the audio sink
  (which charges the device's inbound budget);
- every datagram that fails a check is charged to its source address (IPv4 address, IPv6 /64)
  in a token bucket; a source whose bucket is empty is dropped before any decryption, except
  from a session's confirmed peer. The table of sources is an LRU with a cap.

See docs/mqtt.md, "UDP audio", for what this does and does not stop.

The packet itself (header, cipher, structural checks, Opus plausibility) is
`backend.transports.udp_packet`, sans I/O; `UdpAudioChannel` is the one asyncio datagram
endpoint that all sessions share.
"""

import asyncio
import ipaddress
import math
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from backend.common import KeyedBuckets, TokenBucket
from backend.errors import listen_errors
from backend.logs import EventBudget
from backend.protocol.audio import AudioFrame
from backend.transports.errors import PacketError, UdpError
from backend.transports.udp_packet import (
    DEFAULT_MAX_PAYLOAD,
    HEADER_SIZE,
    CtrKeystream,
    DropReason,
    PacketHeader,
    build_header,
    new_key,
    new_nonce,
    opus_packet_ok,
    parse_header,
)

log = structlog.get_logger("transport.udp")

MAX_SEQUENCE_JUMP = 1 << 16  # ~65 minutes of 60 ms frames lost in a row: not a live device

Address = tuple[str, int]
AudioSink = Callable[[AudioFrame], None]


@dataclass(frozen=True, slots=True)
class UdpLimits:
    """How the channel guards a session's peer address and its own CPU (docs/mqtt.md)."""

    move_confirmations: int = 4  # consecutive valid packets from a new address before a move
    move_interval_s: float = 5.0  # at most one move per session in this long
    max_candidates: int = 4  # new addresses tracked per session at once
    first_sequence_max: int = 64  # a hello's first uplink is sequence 1; allow for early losses
    unconfirmed_burst: float = 16.0  # frames an unconfirmed peer may deliver at once ...
    unconfirmed_per_s: float = 50.0  # ... and per second (a device sends ~17)
    source_failures_per_s: float = 50.0  # bad datagrams a source address may send, sustained
    source_burst: float = 200.0  # ... and in a burst
    max_sources: int = 4096  # source addresses remembered (LRU)

    def __post_init__(self) -> None:
        if self.move_confirmations < 1 or self.max_candidates < 1 or self.max_sources < 1:
            raise UdpError("move_confirmations, max_candidates and max_sources must be >= 1")
        if self.source_failures_per_s <= 0 or self.source_burst < 1:
            raise UdpError("the source budget needs a positive rate and a burst of at least 1")


DEFAULT_LIMITS = UdpLimits()


# ---- sessions and the endpoint ------------------------------------------------------------------

MAX_LEARNED_TOCS = 8  # distinct TOC bytes remembered per session (mode and bandwidth switches)


class _Candidate:
    """A new source address of a session, on its way to becoming the peer."""

    __slots__ = ("count", "held", "last_seq", "toc")

    def __init__(self, keep: int) -> None:
        self.count = 0
        self.last_seq = 0
        self.toc = -1
        self.held: deque[AudioFrame] = deque(maxlen=keep)  # delivered if the move happens


class UdpSession:
    """One audio channel: key, nonce (cookie), peer address, sequence state, audio sink.

    The peer is learned from the first valid uplink (sequence near 1), and is *unconfirmed*
    until it has sent `move_confirmations` consecutive well-formed Opus packets with one TOC
    byte (what an encoder does and noise does not). An unconfirmed peer delivers at most a
    device's rate, and another address that sends such a run takes over at once: whoever raced
    the device's first packet with a guessed cookie keeps the session for a few packets only.
    A confirmed peer moves only as the module docstring says. Only the peer's packets advance
    `last_uplink_seq` or reach `on_audio`."""

    __slots__ = (
        "_candidates",
        "_ctr",
        "_limits",
        "_log",
        "_provisional",
        "_streak",
        "_streak_toc",
        "_tocs",
        "accepted",
        "closed",
        "confirmed",
        "cookie",
        "device_id",
        "downlink_seq",
        "drops",
        "key",
        "last_uplink_seq",
        "moved_at",
        "moves",
        "nonce",
        "on_audio",
        "peer",
        "session_id",
    )

    def __init__(
        self,
        device_id: str,
        session_id: str,
        cookie: int,
        key: bytes,
        on_audio: AudioSink,
        *,
        limits: UdpLimits = DEFAULT_LIMITS,
    ) -> None:
        self.device_id = device_id
        self.session_id = session_id
        self.cookie = cookie
        self.key = key
        self.nonce = new_nonce(cookie)
        self.on_audio = on_audio
        self.peer: Address | None = None
        self.last_uplink_seq = 0  # the device's first packet after a hello is sequence 1
        self.downlink_seq = 0
        self.accepted = 0
        self.moves = 0
        self.moved_at = -math.inf
        self.closed = False
        self.confirmed = False
        self._streak = 0  # consecutive well-formed Opus packets with one TOC from the peer
        self._streak_toc = -1
        self._provisional = TokenBucket(
            limits.unconfirmed_per_s, limits.unconfirmed_burst, -math.inf
        )
        self._limits = limits
        self._candidates: OrderedDict[Address, _Candidate] = OrderedDict()
        self._tocs: list[int] = []  # TOC bytes of the peer's well-formed Opus packets
        self._ctr = CtrKeystream(key)
        self._log = log.bind(device_id=device_id, session_id=session_id)
        self.drops = _drop_log(self._log)

    def hello_block(self, server: str, port: int) -> dict[str, object]:
        """The `udp` object of the server hello (key and nonce as 32 hex digits)."""
        return {"server": server, "port": port, "key": self.key.hex(), "nonce": self.nonce.hex()}

    def accept(
        self, datagram: bytes, header: PacketHeader, source: Address, now: float = 0.0
    ) -> list[AudioFrame] | DropReason:
        """The frames a structurally valid datagram releases (none while a new address is on
        probation, several when its probation ends), or why it was dropped."""
        if self.peer is None:
            if header.sequence > self._limits.first_sequence_max:
                detail = f"first sequence {header.sequence}"
                self.drops.hit(DropReason.LATE_START, detail=detail)
                return DropReason.LATE_START
            return self._from_peer(datagram, header, source, now)
        if source == self.peer:
            return self._from_peer(datagram, header, source, now)
        return self._from_candidate(datagram, header, source, now)

    def _sequence_drop(self, sequence: int, last: int) -> DropReason | None:
        if sequence <= last:
            self.drops.hit(DropReason.REPLAY, detail=f"sequence {sequence} <= {last}")
            return DropReason.REPLAY
        if sequence - last > MAX_SEQUENCE_JUMP:
            # The header is not authenticated (§2.3): without this bound one forged datagram
            # with sequence 0xFFFFFFFF would make every later uplink of the device a "replay".
            self.drops.hit(DropReason.SEQUENCE_JUMP, detail=f"sequence {sequence} after {last}")
            return DropReason.SEQUENCE_JUMP
        return None

    def _from_peer(
        self, datagram: bytes, header: PacketHeader, source: Address, now: float
    ) -> list[AudioFrame] | DropReason:
        dropped = self._sequence_drop(header.sequence, self.last_uplink_seq)
        if dropped is not None:
            return dropped
        if not self.confirmed and not self._provisional.take(now):
            self.drops.hit(DropReason.UNCONFIRMED_RATE, detail=f"from {source[0]}")
            return DropReason.UNCONFIRMED_RATE
        self.last_uplink_seq = header.sequence
        self.peer = source
        if self.confirmed:
            self._candidates.clear()  # the device is still here: probation starts over
        self.accepted += 1
        payload = self._ctr.xor(datagram[:HEADER_SIZE], datagram[HEADER_SIZE:])
        if self.confirmed:
            self._learn(payload)
        else:
            self._confirm_by_streak(payload)
        return [AudioFrame(payload, header.timestamp)]

    def _confirm_by_streak(self, payload: bytes) -> None:
        if not opus_packet_ok(payload):
            self._streak = 0
            return
        if payload[0] != self._streak_toc:
            self._streak, self._streak_toc = 0, payload[0]
        self._streak += 1
        if self._streak >= self._limits.move_confirmations:
            self.confirmed = True
            self._learn(payload)

    def _learn(self, payload: bytes) -> None:
        if not payload or payload[0] in self._tocs or not opus_packet_ok(payload):
            return
        self._tocs.append(payload[0])
        if len(self._tocs) > MAX_LEARNED_TOCS:
            del self._tocs[0]

    @property
    def candidates(self) -> int:
        """New source addresses on probation."""
        return len(self._candidates)

    def plausible(self, payload: bytes) -> bool:
        """Could this be the device's next Opus packet? Well-formed, and (once the peer has sent
        any well-formed one) with a TOC byte its encoder has used: noise passes about 1 in 500."""
        if not opus_packet_ok(payload):
            return False
        return not self._tocs or payload[0] in self._tocs

    def _from_candidate(
        self, datagram: bytes, header: PacketHeader, source: Address, now: float
    ) -> list[AudioFrame] | DropReason:
        candidate = self._candidates.pop(source, None)  # any failure ends its streak
        own = 0 if candidate is None else candidate.last_seq
        # An unconfirmed peer may be the one that raced the device: its sequence is not ours.
        base = max(own, self.last_uplink_seq) if self.confirmed else own
        dropped = self._sequence_drop(header.sequence, base)
        if dropped is not None:
            return dropped
        payload = self._ctr.xor(datagram[:HEADER_SIZE], datagram[HEADER_SIZE:])
        if not self._candidate_plausible(payload, candidate):
            self.drops.hit(DropReason.IMPLAUSIBLE, detail=f"{len(payload)} bytes from {source[0]}")
            return DropReason.IMPLAUSIBLE
        if candidate is None:
            candidate = _Candidate(self._limits.move_confirmations)
            while len(self._candidates) >= self._limits.max_candidates:
                self._candidates.popitem(last=False)
        candidate.count += 1
        candidate.last_seq = header.sequence
        candidate.toc = payload[0]
        candidate.held.append(AudioFrame(payload, header.timestamp))
        self._candidates[source] = candidate
        if candidate.count < self._limits.move_confirmations:
            return []
        if self.confirmed and now - self.moved_at < self._limits.move_interval_s:
            return []  # moved a moment ago: stay on probation until the interval has passed
        return self._move(source, candidate, now)

    def _candidate_plausible(self, payload: bytes, candidate: _Candidate | None) -> bool:
        if self.confirmed:
            return self.plausible(payload)
        # Nothing learned from an unconfirmed peer: the run must keep its own TOC byte.
        if not opus_packet_ok(payload):
            return False
        return candidate is None or payload[0] == candidate.toc

    def _move(self, source: Address, candidate: _Candidate, now: float) -> list[AudioFrame]:
        self._log.info(
            "udp peer moved",
            old=_show(self.peer),
            new=_show(source),
            confirmations=candidate.count,
        )
        self.peer = source
        self.last_uplink_seq = candidate.last_seq
        self.moved_at = now
        self.moves += 1
        self.confirmed = True  # the run that moved it is the confirmation
        self._candidates.clear()
        frames = list(candidate.held)
        self.accepted += len(frames)
        for frame in frames:
            self._learn(frame.payload)
        return frames

    def seal_downlink(self, frame: AudioFrame) -> bytes:
        """Encrypt one downlink packet with the next sequence number (first is 1)."""
        self.downlink_seq += 1
        header = build_header(self.nonce, len(frame.payload), frame.timestamp_ms, self.downlink_seq)
        return header + self._ctr.xor(header, frame.payload)


def _show(address: Address | None) -> str | None:
    return None if address is None else f"{address[0]}:{address[1]}"


def _drop_log(logger: structlog.typing.FilteringBoundLogger) -> EventBudget:
    return EventBudget(logger, "udp datagram dropped", first=3, summary_interval_s=60.0)


def source_key(host: str) -> str:
    """Whom a failure is charged to: the IPv4 address, or the /64 of an IPv6 one (one host's
    share of addresses); any source port, so port rotation buys nothing."""
    if ":" not in host:
        return host
    try:
        network = ipaddress.IPv6Network((host.split("%", 1)[0], 64), strict=False)
    except ValueError:
        return host
    return str(network)


class SourceBudgets:
    """A token bucket of failures per source address, in an LRU of at most `max_sources`.

    Entries are made only by failures, so devices that behave never take a slot; an evicted
    source starts again with a full bucket, which bounds memory, not the attacker's total."""

    def __init__(self, limits: UdpLimits) -> None:
        self._buckets = KeyedBuckets(
            limits.source_failures_per_s, limits.source_burst, limit=limits.max_sources
        )

    def __len__(self) -> int:
        return len(self._buckets)

    @property
    def evicted(self) -> int:
        """Sources forgotten to make room for newer ones."""
        return self._buckets.evicted

    def exhausted(self, key: str, now: float) -> bool:
        """Whether the source has no failures left to spend (its datagrams are dropped unread)."""
        bucket = self._buckets.peek(key)
        return bucket is not None and bucket.refill(now) < 1.0

    def charge(self, key: str, now: float) -> bool:
        """One failure of `key`; True when this one emptied its bucket."""
        bucket = self._buckets.bucket(key, now)
        if not bucket.take(now):
            bucket.tokens = 0.0  # a failure with nothing left spends what had refilled since
            return False
        return bucket.tokens < 1.0


_SOURCE_BUDGET = f"drop_{DropReason.SOURCE_BUDGET}"


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, channel: "UdpAudioChannel") -> None:
        self.channel = channel

    def datagram_received(self, data: bytes, addr: Address) -> None:
        self.channel.handle_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable for an earlier downlink (device gone): nothing to do.
        self.channel.count("icmp_errors")


class UdpAudioChannel:
    """One datagram endpoint for every UDP audio session, demultiplexed by cookie."""

    def __init__(
        self,
        host: str = "0.0.0.0",
        port: int = 8884,
        *,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        limits: UdpLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < max_payload <= 0xFFFF:
            raise UdpError("max_payload must be within 1..65535")
        self.host = host
        self._port = port
        self.max_payload = max_payload
        self.limits = limits or DEFAULT_LIMITS
        self._clock = clock
        self.counters: dict[str, int] = {}
        self._sessions: dict[int, UdpSession] = {}
        self._sources = SourceBudgets(self.limits)
        self._transport: asyncio.DatagramTransport | None = None
        self._global_drops = _drop_log(log.bind(device_id=None))

    # -- lifecycle --

    async def start(self) -> None:
        """Bind the UDP socket; raises a clear error when the port is taken."""
        loop = asyncio.get_running_loop()
        with listen_errors("UDP audio", self.host, self._port, "udp"):
            transport, _protocol = await loop.create_datagram_endpoint(
                lambda: _Protocol(self), local_addr=(self.host, self._port)
            )
        self._transport = transport
        self._port = transport.get_extra_info("sockname")[1]
        log.info("udp audio channel listening", host=self.host, port=self._port)

    async def stop(self) -> None:
        """Close every session and the socket."""
        for session in list(self._sessions.values()):
            self.close_session(session)
        self._global_drops.flush()
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    @property
    def port(self) -> int:
        """The bound port (the real one when configured as 0)."""
        return self._port

    @property
    def running(self) -> bool:
        """Whether the socket is bound."""
        return self._transport is not None

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a named counter of the channel's stats."""
        self.counters[name] = self.counters.get(name, 0) + amount

    def stats(self) -> dict[str, int]:
        """The channel's counters, sessions and the source table's size and evictions."""
        return {
            **self.counters,
            "sessions": len(self._sessions),
            "sources": len(self._sources),
            "sources_evicted": self._sources.evicted,
        }

    # -- sessions --

    def open_session(self, device_id: str, session_id: str, on_audio: AudioSink) -> UdpSession:
        """A new session with a fresh key and an unused cookie."""
        while True:
            cookie = int.from_bytes(os.urandom(4), "big")
            if cookie and cookie not in self._sessions:
                break
        session = UdpSession(device_id, session_id, cookie, new_key(), on_audio, limits=self.limits)
        self._sessions[cookie] = session
        self.count("sessions_opened")
        return session

    def close_session(self, session: UdpSession) -> None:
        """Forget a session (idempotent); later datagrams with its cookie are unknown."""
        if session.closed:
            return
        session.closed = True
        if self._sessions.get(session.cookie) is session:
            del self._sessions[session.cookie]
        session.drops.flush()
        self.count("sessions_closed")

    def session(self, cookie: int) -> UdpSession | None:
        """The session with this cookie, if open."""
        return self._sessions.get(cookie)

    # -- uplink (hot path) --

    def handle_datagram(self, data: bytes, source: Address) -> None:
        """Validate, route and decrypt one datagram; drops are counted, never raised."""
        self.count("rx_datagrams")
        now = self._clock()
        session = self._attribute(data)
        trusted = session is not None and (
            session.peer is None or (session.confirmed and session.peer == source)
        )
        key = source_key(source[0])
        if not trusted and self._sources.exhausted(key, now):
            # Before any decryption, and no log line: this address has had its share (the line
            # was written when its bucket ran out).
            self.counters[_SOURCE_BUDGET] = self.counters.get(_SOURCE_BUDGET, 0) + 1
            return
        try:
            header = parse_header(data, self.max_payload)
        except PacketError as exc:
            self._fail(key, now, exc.reason, str(exc), session)
            return
        if session is None:
            self._fail(key, now, DropReason.UNKNOWN_COOKIE, f"cookie {header.ssrc:08x} from {key}")
            return
        moves = session.moves
        frames = session.accept(data, header, source, now)
        if session.moves != moves:
            self.count("peer_moves")
        if isinstance(frames, DropReason):  # the session has logged it under its device
            self._charge(key, now)
            self.count(f"drop_{frames}")
            return
        self._deliver(session, frames)

    def _deliver(self, session: UdpSession, frames: list[AudioFrame]) -> None:
        if not frames:
            self.count("rx_held")  # valid, from an address on probation
            return
        if len(frames) > 1 or (session.peer is not None and session.moves and not session.accepted):
            pass
        for frame in frames:
            self.count("rx_audio")
            try:
                session.on_audio(frame)
            except Exception as exc:  # a faulty sink must not stop the endpoint
                self._drop(DropReason.HANDLER_ERROR, f"{type(exc).__name__}: {exc}", session)

    def _attribute(self, data: bytes) -> UdpSession | None:
        if len(data) >= 8:
            return self._sessions.get(int.from_bytes(data[4:8], "big"))
        return None

    def _fail(
        self,
        key: str,
        now: float,
        reason: DropReason,
        detail: str,
        session: UdpSession | None = None,
    ) -> None:
        self._charge(key, now)
        self._drop(reason, detail, session)

    def _charge(self, key: str, now: float) -> None:
        if self._sources.charge(key, now):
            self._global_drops.hit(DropReason.SOURCE_BUDGET, detail=f"{key} ran out of budget")

    def _drop(self, reason: DropReason, detail: str, session: UdpSession | None = None) -> None:
        self.count(f"drop_{reason}")
        (session.drops if session is not None else self._global_drops).hit(reason, detail=detail)

    # -- downlink --

    def send(self, session: UdpSession, frame: AudioFrame) -> bool:
        """Send one Opus packet to the session's peer address; False if dropped."""
        if self._transport is None or session.closed:
            raise UdpError("udp session is closed")
        if len(frame.payload) > self.max_payload:
            self._drop(DropReason.OVERSIZED, f"downlink of {len(frame.payload)} bytes", session)
            return False
        if session.peer is None:
            self._drop(DropReason.NO_PEER, "no uplink received yet", session)
            return False
        datagram = session.seal_downlink(frame)
        try:
            self._transport.sendto(datagram, session.peer)
        except OSError as exc:
            self._drop(DropReason.SEND_ERROR, str(exc), session)
            return False
        self.count("tx_audio")
        return True
