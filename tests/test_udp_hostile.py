"""The UDP audio channel under attack, over real sockets on loopback (issue 16, item 7).

The victim is a device socket on 127.0.0.1; attackers bind other loopback addresses
(127.0.0.2 and up: all of 127.0.0.0/8 is local on Linux) or other ports of the victim's address.
Attackers know the session's cookie (as if guessed, or seen on the path) but not its key.
The clock of the channel is a `ManualClock`, so budgets and move intervals are exact: no test
depends on how fast this machine is.
"""

import random
from collections.abc import AsyncIterator, Iterator

import pytest

from backend.protocol.audio import AudioFrame
from backend.transports.udp import (
    UdpAudioChannel,
    UdpLimits,
    UdpSession,
)
from backend.transports.udp_packet import (
    opus_packet_ok,
    parse_header,
)
from tests.helpers import ManualClock
from tests.mqtt_helpers import eventually
from tests.udp_helpers import OPUS_60MS, DeviceSocket, device_open, device_packet

ROUND = 100  # datagrams per round, then wait until all arrived: no kernel buffer overflow


class Device:
    """The victim: streams well-formed 60 ms Opus packets from its socket."""

    def __init__(self, sock: DeviceSocket, session: UdpSession) -> None:
        block = session.hello_block("127.0.0.1", 1)
        self.key, self.nonce = bytes.fromhex(str(block["key"])), bytes.fromhex(str(block["nonce"]))
        self.sock = sock
        self.sequence = 0
        self.sent: list[bytes] = []

    def speak(self) -> bytes:
        self.sequence += 1
        payload = OPUS_60MS + self.sequence.to_bytes(4, "big")
        self.sock.send(device_packet(self.key, self.nonce, payload, self.sequence))
        self.sent.append(payload)
        return payload


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def sockets() -> Iterator[list[DeviceSocket]]:
    made: list[DeviceSocket] = []
    yield made
    for sock in made:
        sock.close()


async def started(clock: ManualClock, **limits: float) -> UdpAudioChannel:
    channel = UdpAudioChannel("127.0.0.1", 0, limits=UdpLimits(**limits), clock=clock)  # type: ignore[arg-type]
    await channel.start()
    return channel


@pytest.fixture
async def channel(clock: ManualClock) -> AsyncIterator[UdpAudioChannel]:
    udp = await started(clock)
    yield udp
    await udp.stop()


def sock(made: list[DeviceSocket], host: str, port: int) -> DeviceSocket:
    made.append(DeviceSocket(port, host))
    return made[-1]


async def live_device(
    channel: UdpAudioChannel, made: list[DeviceSocket], frames: list[AudioFrame]
) -> tuple[UdpSession, Device]:
    """A session whose device has sent enough of its stream for the peer to be confirmed."""
    session = channel.open_session("a4:cf:12:34:56:78", "s1", frames.append)
    device = Device(sock(made, "127.0.0.1", channel.port), session)
    for _ in range(channel.limits.move_confirmations):
        device.speak()
    await eventually(lambda: len(frames) == len(device.sent), what="the device's first frames")
    assert session.peer == device.sock.address and session.confirmed
    return session, device


def forged(device: Device, sequence: int, rng: random.Random) -> bytes:
    """Right cookie and a sequence ahead, without the key: any ciphertext is a guess."""
    payload = OPUS_60MS + rng.randbytes(4)
    return device_packet(rng.randbytes(16), device.nonce, payload, sequence)


async def in_rounds(
    channel: UdpAudioChannel, datagrams: list[bytes], attacker: DeviceSocket, between: object = None
) -> None:
    for start in range(0, len(datagrams), ROUND):
        expected = channel.counters.get("rx_datagrams", 0) + len(datagrams[start : start + ROUND])
        for datagram in datagrams[start : start + ROUND]:
            attacker.send(datagram)
        await eventually(
            lambda: channel.counters.get("rx_datagrams") == expected,  # noqa: B023
            what="the round",
        )
        if callable(between):
            await between()


async def test_a_blind_hijack_with_the_right_cookie_but_no_key_never_moves_the_peer(
    clock: ManualClock, sockets: list[DeviceSocket]
) -> None:
    # A budget that never runs out: every forgery is decrypted and judged by its content.
    channel = await started(clock, source_burst=1e9)
    try:
        frames: list[AudioFrame] = []
        session, device = await live_device(channel, sockets, frames)
        attacker = sock(sockets, "127.0.0.2", channel.port)
        rng = random.Random(16)
        # Sequences just ahead of the device's, as a blind attacker would pick (they start at 1).
        datagrams = [forged(device, 2 + n // 4, rng) for n in range(4_000)]
        await in_rounds(channel, datagrams, attacker)

        assert session.peer == device.sock.address
        assert channel.counters.get("peer_moves", 0) == 0
        assert [frame.payload for frame in frames] == device.sent  # nothing forged delivered
        assert channel.counters["drop_implausible"] + channel.counters["drop_replay"] > 3_000
        channel.send(session, AudioFrame(b"to the device"))
        assert device_open(device.key, await device.sock.recv())[2] == b"to the device"
        assert not attacker.pending()
        device.speak()  # the forgeries did not move the device's sequence either
        await eventually(lambda: len(frames) == len(device.sent), what="the device's next frame")
    finally:
        await channel.stop()


async def test_a_flood_with_a_known_cookie_from_elsewhere_never_cuts_the_device_off(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    frames: list[AudioFrame] = []
    session, device = await live_device(channel, sockets, frames)
    attacker = sock(sockets, "127.0.0.2", channel.port)
    neighbour = sock(sockets, "127.0.0.1", channel.port)  # the device's own address, another port
    rng = random.Random(17)
    burst = int(channel.limits.source_burst)

    async def device_speaks() -> None:
        device.speak()
        count = len(device.sent)
        await eventually(lambda: len(frames) == count, what="the device's frame in the flood")

    # Sequences far ahead: charged to the device, these would have made its uplink "replays".
    flood = [forged(device, 60_000 + n, rng) for n in range(20 * ROUND)]
    await in_rounds(channel, flood, attacker, device_speaks)
    await in_rounds(channel, [forged(device, 70_000 + n, rng) for n in range(5 * ROUND)], neighbour)
    await device_speaks()

    assert [frame.payload for frame in frames] == device.sent  # every frame, only the device's
    assert session.peer == device.sock.address and session.last_uplink_seq == device.sequence
    counters = channel.counters
    # The clock stands still: after its burst of failures, each source is dropped before any
    # decryption (a forgery that happens to look like a frame is held, not charged).
    sent = len(flood) + 5 * ROUND
    assert counters["drop_source_budget"] == sent - 2 * burst - counters.get("rx_held", 0)
    stats = channel.stats()
    assert stats["sources"] == 2  # 127.0.0.2 and 127.0.0.1 (the neighbour), nothing per port
    channel.send(session, AudioFrame(b"tts"))
    assert device_open(device.key, await device.sock.recv())[2] == b"tts"


async def test_a_flood_that_races_the_devices_first_packet_loses_the_session_to_the_device(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    frames: list[AudioFrame] = []
    session = channel.open_session("a4:cf:12:34:56:78", "s1", frames.append)
    device = Device(sock(sockets, "127.0.0.1", channel.port), session)
    attacker = sock(sockets, "127.0.0.2", channel.port)
    rng = random.Random(20)
    # Sequences far from 1 cannot be a session's first packet ...
    await in_rounds(channel, [forged(device, 5_000 + n, rng) for n in range(ROUND)], attacker)
    assert session.peer is None and channel.counters["drop_late_start"] > 0
    # ... but a guessed small one can: the attacker becomes the unconfirmed peer.
    await in_rounds(channel, [forged(device, 1 + n, rng) for n in range(ROUND)], attacker)
    assert session.peer == attacker.address and not session.confirmed
    taken = len(frames)
    assert taken <= channel.limits.unconfirmed_burst  # a device's rate at most, then dropped
    assert channel.counters["drop_unconfirmed_rate"] > 0
    # The device's own stream (its sequence restarts at 1; the attacker's does not count).
    for _ in range(channel.limits.move_confirmations):
        device.speak()
    await eventually(lambda: session.peer == device.sock.address, what="the device takes over")
    assert session.confirmed and [f.payload for f in frames[taken:]] == device.sent
    channel.send(session, AudioFrame(b"tts"))
    assert device_open(device.key, await device.sock.recv())[2] == b"tts"
    await in_rounds(channel, [forged(device, 200 + n, rng) for n in range(ROUND)], attacker)
    device.speak()
    await eventually(lambda: len(frames) - taken == len(device.sent), what="the device's frame")
    assert session.peer == device.sock.address


async def test_nat_rebinding_moves_the_peer_after_the_confirmations_and_not_too_often(
    channel: UdpAudioChannel, clock: ManualClock, sockets: list[DeviceSocket]
) -> None:
    frames: list[AudioFrame] = []
    session, device = await live_device(channel, sockets, frames)
    old = device.sock
    confirmations = channel.limits.move_confirmations

    async def speak_from(new: DeviceSocket, packets: int) -> None:
        device.sock = new
        held = _held(channel) + packets
        for _ in range(packets):
            device.speak()
        await eventually(lambda: _held(channel) == held, what="held on probation")

    new = sock(sockets, "127.0.0.3", channel.port)
    await speak_from(new, confirmations - 1)
    assert len(frames) == confirmations and session.peer == old.address  # old peer kept
    channel.send(session, AudioFrame(b"to the old address"))
    assert device_open(device.key, await old.recv())[2] == b"to the old address"

    device.speak()  # the last confirmation: the peer moves, the held frames are delivered
    await eventually(lambda: len(frames) == len(device.sent), what="the held frames")
    assert [frame.payload for frame in frames] == device.sent
    assert session.peer == new.address and channel.counters["peer_moves"] == 1
    channel.send(session, AudioFrame(b"to the new address"))
    assert device_open(device.key, await new.recv())[2] == b"to the new address"

    # Another rebinding at once: valid, but within the move interval it stays on probation.
    newer = sock(sockets, "127.0.0.4", channel.port)
    await speak_from(newer, confirmations + 2)
    assert session.peer == new.address and session.candidates == 1
    clock.advance(channel.limits.move_interval_s)
    device.speak()
    await eventually(lambda: session.peer == newer.address, what="the second move")
    assert channel.counters["peer_moves"] == 2
    # The last `confirmations` frames are delivered (the older held ones were let go).
    assert [frame.payload for frame in frames[-confirmations:]] == device.sent[-confirmations:]
    assert not old.pending()


def _held(channel: UdpAudioChannel) -> int:
    return channel.counters.get("rx_held", 0)


async def test_a_spray_from_many_ports_and_addresses_keeps_the_tables_bounded(
    clock: ManualClock, sockets: list[DeviceSocket]
) -> None:
    channel = await started(clock, max_sources=32, max_candidates=2, source_burst=4)
    try:
        frames: list[AudioFrame] = []
        session, device = await live_device(channel, sockets, frames)
        rng = random.Random(18)
        sprayers = [sock(sockets, "127.0.0.5", channel.port) for _ in range(300)]
        sprayers += [sock(sockets, f"127.0.1.{n}", channel.port) for n in range(1, 201)]
        for start in range(0, len(sprayers), ROUND):
            batch = sprayers[start : start + ROUND]
            expected = channel.counters["rx_datagrams"] + 2 * len(batch)
            for index, sprayer in enumerate(batch):
                sprayer.send(forged(device, 1000 + start + index, rng))
                sprayer.send(rng.randbytes(40))  # not even a packet
            await eventually(lambda: channel.counters["rx_datagrams"] == expected)  # noqa: B023
        assert len(sockets) - 1 == 500
        stats = channel.stats()
        assert stats["sources"] <= 32 and stats["sources_evicted"] >= 200 - 32
        # Copies of the device's own packets (an on-path replayer) from many addresses: valid,
        # so they are candidates, and their table is bounded too.
        held = _held(channel)
        for index, sprayer in enumerate(sprayers[300:340]):
            packet = OPUS_60MS + bytes([index])
            sprayer.send(
                device_packet(device.key, device.nonce, packet, device.sequence + 1 + index)
            )
        await eventually(lambda: _held(channel) == held + 40, what="the copies")
        assert session.candidates <= 2
        assert [frame.payload for frame in frames] == device.sent
        assert session.peer == device.sock.address
    finally:
        await channel.stop()


def test_random_noise_is_rarely_a_frame_of_the_devices_stream() -> None:
    session = UdpSession("dev", "s", 1, bytes(16), lambda _frame: None)
    assert session.plausible(b"\x03\x01")  # nothing learned yet: the RFC's rules only
    for sequence in range(1, 5):
        datagram = device_packet(bytes(16), session.nonce, OPUS_60MS, sequence)
        session.accept(datagram, parse_header(datagram), ("127.0.0.1", 1))
    assert session.confirmed
    rng = random.Random(19)
    noise = [rng.randbytes(rng.randrange(1, 200)) for _ in range(100_000)]
    well_formed = sum(opus_packet_ok(sample) for sample in noise)
    plausible = sum(session.plausible(sample) for sample in noise)
    assert 0.3 < well_formed / len(noise) < 0.7  # the RFC's rules alone: about half
    assert plausible / len(noise) < 1 / 200  # with the learned TOC byte: about 1 in 256
    assert not session.plausible(b"\x03\x01")


@pytest.mark.parametrize(
    ("packet", "ok"),
    [
        (b"", False),  # R1: at least one byte
        (bytes([0x58]), True),  # code 0, an empty frame (DTX)
        (bytes([0x58]) + bytes(1275), True),
        (bytes([0x58]) + bytes(1276), False),  # R2: a frame is at most 1275 bytes
        (bytes([0x59]) + bytes(10), True),  # code 1: two frames of 5
        (bytes([0x59]) + bytes(9), False),  # R3: an odd remainder
        (bytes([0x5A, 3]) + bytes(5), True),  # code 2: frames of 3 and 2
        (bytes([0x5A, 9]) + bytes(5), False),  # R4: the first length runs past the end
        (bytes([0x5A, 252]), False),  # a two-byte length cut short
        (bytes([0x5B, 0x02]) + bytes(8), True),  # code 3, CBR: 2 frames x 60 ms = 120 ms
        (bytes([0x5B, 0x03]) + bytes(9), False),  # R5: 3 x 60 ms is more than 120 ms
        (bytes([0x5B, 0x00]), False),  # R5: no frames
        (bytes([0x5B, 0x02]) + bytes(7), False),  # R6: CBR remainder not a multiple
        (bytes([0x5B, 0x82, 3]) + bytes(7), True),  # R7: VBR, 3 then 4
        (bytes([0x5B, 0x82, 9]) + bytes(7), False),  # R7: the lengths run past the end
        (bytes([0x5B, 0x42, 2]) + bytes(4) + bytes(2), True),  # padding of 2
        (bytes([0x5B, 0x42, 255, 1]) + bytes(255), True),  # padding of 254 + 1
        (bytes([0x5B, 0x42, 255]), False),  # padding length cut short
    ],
)
def test_opus_packet_rules(packet: bytes, ok: bool) -> None:
    assert opus_packet_ok(packet) is ok
