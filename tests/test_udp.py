"""The UDP audio channel (reference §2.3): codec, crypto, drops, sequence rules, address learning.

The device side here is written independently of `backend.transports.udp`: it builds its header
from the hello's nonce exactly as the firmware does (bytes 2-3, 8-11, 12-15 overwritten) and
encrypts with `cryptography` directly. Everything that crosses a socket crosses a real one on
loopback.
"""

import random
from collections.abc import AsyncIterator, Iterator

import pytest
import structlog
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.logs import EventBudget
from backend.protocol.audio import AudioFrame
from backend.transports.errors import PacketError, UdpError
from backend.transports.udp import (
    SourceBudgets,
    UdpAudioChannel,
    UdpLimits,
    UdpSession,
)
from backend.transports.udp_packet import (
    CtrKeystream,
    DropReason,
    build_header,
    ctr_xor,
    new_nonce,
    open_packet,
    parse_header,
    seal,
)
from tests.mqtt_helpers import eventually
from tests.udp_helpers import (
    OPUS_60MS,
    DeviceSocket,
    device_header,
    device_open,
    device_packet,
)

# The device's side, written from the protocol reference, lives in tests/udp_helpers.py.


@pytest.fixture
async def channel() -> AsyncIterator[UdpAudioChannel]:
    udp = UdpAudioChannel("127.0.0.1", 0, max_payload=1000)
    await udp.start()
    yield udp
    await udp.stop()


@pytest.fixture
def sockets(channel: UdpAudioChannel) -> Iterator[list[DeviceSocket]]:
    made: list[DeviceSocket] = []
    yield made
    for sock in made:
        sock.close()


def open_session(channel: UdpAudioChannel) -> tuple[UdpSession, list[AudioFrame]]:
    frames: list[AudioFrame] = []
    return channel.open_session("a4:cf:12:34:56:78", "s1", frames.append), frames


def hello_key_nonce(session: UdpSession) -> tuple[bytes, bytes]:
    block = session.hello_block("127.0.0.1", 1)
    key, nonce = bytes.fromhex(str(block["key"])), bytes.fromhex(str(block["nonce"]))
    return key, nonce


# ---- pure codec ----------------------------------------------------------------------------------


def test_hello_block_follows_the_firmware_rules(channel: UdpAudioChannel) -> None:
    session, _ = open_session(channel)
    block = session.hello_block("203.0.113.5", 8884)
    assert block["server"] == "203.0.113.5" and block["port"] == 8884
    key, nonce = bytes.fromhex(str(block["key"])), bytes.fromhex(str(block["nonce"]))
    assert len(key) == 16 and len(nonce) == 16
    assert nonce[0] == 0x01
    assert int.from_bytes(nonce[4:8], "big") == session.cookie != 0
    other, _ = open_session(channel)
    assert other.cookie != session.cookie and other.key != session.key


def test_header_is_the_nonce_with_three_fields_overwritten() -> None:
    nonce = bytes(range(0x10, 0x20))  # every byte distinct, so a wrong copy shows
    header = build_header(nonce, 0x1234, 0xDEADBEEF, 7)
    assert header == device_header(nonce, 0x1234, 0xDEADBEEF, 7)
    assert header[0:2] == nonce[0:2] and header[4:8] == nonce[4:8]


def test_ctr_uses_the_whole_header_as_one_128_bit_counter() -> None:
    key = bytes(range(16))
    # Low bytes all 0xff: the counter must carry into byte 11 and beyond for the second block.
    header = new_nonce(0xC0FFEE01)[:8] + b"\x00\x00\x00\x00\xff\xff\xff\xff"
    data = bytes(40)  # three blocks
    ecb = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    start = int.from_bytes(header, "big")
    stream = b"".join(ecb.update(((start + i) % 2**128).to_bytes(16, "big")) for i in range(3))
    assert ctr_xor(key, header, data) == stream[:40]


@given(
    key=st.binary(min_size=16, max_size=16),
    header=st.sampled_from([bytes(16), b"\xff" * 16, b"\x01" + b"\x00" * 11 + b"\xff" * 4])
    | st.binary(min_size=16, max_size=16),
    data=st.binary(max_size=1500),
)
def test_the_fast_keystream_equals_aes_ctr(key: bytes, header: bytes, data: bytes) -> None:
    reference = Cipher(algorithms.AES(key), modes.CTR(header)).encryptor().update(data)
    assert CtrKeystream(key).xor(header, data) == reference
    assert ctr_xor(key, header, data) == reference


def test_seal_and_open_round_trip_with_the_device_side() -> None:
    key, nonce = bytes(16), new_nonce(42)
    datagram = seal(key, nonce, b"opus-frame", 99, 5)
    assert device_open(key, datagram) == (5, 99, b"opus-frame")
    header, payload = open_packet(key, device_packet(key, nonce, b"uplink", 3, 7))
    assert (header.sequence, header.timestamp, header.ssrc, payload) == (3, 7, 42, b"uplink")


@pytest.mark.parametrize(
    ("datagram", "reason"),
    [
        (b"\x01" * 15, DropReason.SHORT),
        (b"\x02" + bytes(15), DropReason.BAD_TYPE),
        (device_header(new_nonce(1), 10, 0, 1) + bytes(9), DropReason.BAD_LENGTH),
        (device_header(new_nonce(1), 10, 0, 1) + bytes(11), DropReason.BAD_LENGTH),
        (device_header(new_nonce(1), 1001, 0, 1) + bytes(1001), DropReason.OVERSIZED),
    ],
)
def test_parse_header_rejects(datagram: bytes, reason: DropReason) -> None:
    with pytest.raises(PacketError) as caught:
        parse_header(datagram, max_payload=1000)
    assert caught.value.reason is reason


def test_empty_payload_is_a_valid_packet() -> None:
    header = parse_header(device_header(new_nonce(1), 0, 0, 1))
    assert header.payload_len == 0


# ---- over real sockets --------------------------------------------------------------------------


async def test_uplink_and_downlink_round_trip(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    session, frames = open_session(channel)
    key, nonce = hello_key_nonce(session)
    dev = DeviceSocket(channel.port)
    sockets.append(dev)
    dev.send(device_packet(key, nonce, b"hello opus", 1, ts=0))
    await eventually(lambda: len(frames) == 1, what="uplink frame")
    assert frames[0] == AudioFrame(b"hello opus", 0)

    for index in range(1, 4):
        assert channel.send(session, AudioFrame(f"down-{index}".encode(), 60 * index))
        sequence, timestamp, payload = device_open(key, await dev.recv())
        assert (sequence, timestamp, payload) == (index, 60 * index, f"down-{index}".encode())
    assert channel.counters["rx_audio"] == 1 and channel.counters["tx_audio"] == 3


async def test_bad_datagrams_are_dropped_and_counted(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    session, frames = open_session(channel)
    key, nonce = hello_key_nonce(session)
    stale, _ = open_session(channel)
    stale_key, stale_nonce = hello_key_nonce(stale)
    channel.close_session(stale)  # e.g. the previous conversation's key and nonce
    dev = DeviceSocket(channel.port)
    sockets.append(dev)

    good = device_packet(key, nonce, b"frame-1", 1)
    dev.send(good)
    dev.send(good)  # replay
    dev.send(device_packet(key, nonce, b"frame-0", 0))  # sequence not above the last
    dev.send(good[:-3])  # truncated
    dev.send(good + b"pad")  # longer than payload_len says
    dev.send(device_packet(key, nonce, bytes(1001), 2))  # above max_payload
    dev.send(device_packet(stale_key, stale_nonce, b"old", 2))  # closed session: unknown cookie
    dev.send(device_packet(key, new_nonce(0x0BADC0DE), b"x", 2))  # nobody's cookie
    dev.send(b"\x01\x00\x00")  # short
    dev.send(b"\x05" + good[1:])  # wrong type byte
    dev.send(device_packet(key, nonce, b"forged", 0xFFFFFFFF))  # would block every later one
    dev.send(device_packet(key, nonce, b"frame-9", 9))  # valid again: a gap is fine
    await eventually(lambda: len(frames) == 2, what="both valid frames")

    assert [frame.payload for frame in frames] == [b"frame-1", b"frame-9"]
    counters = channel.counters
    assert counters["drop_sequence_jump"] == 1
    assert counters["drop_replay"] == 2
    assert counters["drop_bad_length"] == 2
    assert counters["drop_oversized"] == 1
    assert counters["drop_unknown_cookie"] == 2
    assert counters["drop_short"] == 1
    assert counters["drop_bad_type"] == 1
    assert counters["rx_datagrams"] == 12 and counters["rx_audio"] == 2


async def test_a_forged_packet_with_a_live_cookie_but_wrong_key_decrypts_to_noise(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    # The stock protocol has no authentication tag: this is the limit of what can be checked.
    session, frames = open_session(channel)
    _key, nonce = hello_key_nonce(session)
    dev = DeviceSocket(channel.port)
    sockets.append(dev)
    dev.send(device_packet(bytes(16), nonce, b"forged plaintext", 1))
    await eventually(lambda: len(frames) == 1, what="the forged frame")
    assert frames[0].payload != b"forged plaintext"


async def test_address_learned_from_the_first_uplink_and_moved_only_after_probation(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    session, frames = open_session(channel)
    key, nonce = hello_key_nonce(session)
    first, moved, spoofer = (DeviceSocket(channel.port) for _ in range(3))
    sockets += [first, moved, spoofer]
    confirmations = channel.limits.move_confirmations

    assert not channel.send(session, AudioFrame(b"too early"))  # no uplink yet: nowhere to send
    assert channel.counters["drop_no_peer"] == 1
    assert not channel.send(session, AudioFrame(bytes(1001)))  # above max_payload: never sent
    assert channel.counters["drop_oversized"] == 1

    first.send(device_packet(key, nonce, OPUS_60MS + b"a", 1))
    await eventually(lambda: len(frames) == 1)
    channel.send(session, AudioFrame(b"to first"))
    assert device_open(key, await first.recv())[2] == b"to first"

    # NAT rebinding: a new source port. Until `confirmations` valid packets came from it, the
    # downlink stays with the old address and nothing from the new one is delivered.
    for sequence in range(2, 1 + confirmations):
        moved.send(device_packet(key, nonce, OPUS_60MS + bytes([sequence]), sequence))
    await eventually(lambda: channel.counters.get("rx_held") == confirmations - 1)
    assert len(frames) == 1
    channel.send(session, AudioFrame(b"still to first"))
    assert device_open(key, await first.recv())[2] == b"still to first"

    last = 1 + confirmations
    moved.send(device_packet(key, nonce, OPUS_60MS + bytes([last]), last))
    await eventually(lambda: len(frames) == 1 + confirmations)  # the held ones, in order
    assert [f.payload[-1] for f in frames[1:]] == list(range(2, last + 1))
    spoofer.send(device_packet(key, nonce, OPUS_60MS + bytes([last]), last))  # a replay
    await eventually(lambda: channel.counters.get("drop_replay") == 1)
    channel.send(session, AudioFrame(b"to moved"))
    assert device_open(key, await moved.recv()) == (3, 0, b"to moved")  # one sequence
    assert not first.pending() and not spoofer.pending()
    assert channel.counters["peer_moves"] == 1


async def test_a_new_session_restarts_both_sequences(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    old, old_frames = open_session(channel)
    key, nonce = hello_key_nonce(old)
    dev = DeviceSocket(channel.port)
    sockets.append(dev)
    dev.send(device_packet(key, nonce, b"a", 5))
    await eventually(lambda: len(old_frames) == 1)
    channel.send(old, AudioFrame(b"x"))
    channel.send(old, AudioFrame(b"y"))
    assert device_open(key, await dev.recv())[0] == 1
    assert device_open(key, await dev.recv())[0] == 2

    channel.close_session(old)  # a new hello replaces the session
    new, new_frames = open_session(channel)
    new_key, new_nonce = hello_key_nonce(new)
    dev.send(device_packet(new_key, new_nonce, b"b", 1))  # the device restarts at 1
    await eventually(lambda: len(new_frames) == 1)
    channel.send(new, AudioFrame(b"z"))
    assert device_open(new_key, await dev.recv())[0] == 1
    with pytest.raises(UdpError):
        channel.send(old, AudioFrame(b"late"))


async def test_a_failing_sink_is_counted_and_the_endpoint_keeps_going(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    delivered: list[bytes] = []

    def sink(frame: AudioFrame) -> None:
        if frame.payload == b"boom":
            raise RuntimeError("session bug")
        delivered.append(frame.payload)

    session = channel.open_session("dev", "s", sink)
    key, nonce = hello_key_nonce(session)
    dev = DeviceSocket(channel.port)
    sockets.append(dev)
    dev.send(device_packet(key, nonce, b"boom", 1))
    dev.send(device_packet(key, nonce, b"fine", 2))
    await eventually(lambda: delivered == [b"fine"])
    assert channel.counters["drop_handler_error"] == 1


async def test_garbage_never_stops_the_endpoint(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    session, frames = open_session(channel)
    key, nonce = hello_key_nonce(session)
    dev = DeviceSocket(channel.port)
    sockets.append(dev)
    rng = random.Random(7)
    sent = 0
    for _round in range(20):  # in rounds, so the kernel's receive buffer never overflows
        for size in [0, 1, 15, 16, 17, 64, 1016, 1017, 4000]:
            junk = bytearray(rng.randbytes(size))
            if size >= 8 and rng.random() < 0.5:
                junk[0] = 0x01
                junk[4:8] = nonce[4:8]  # a live cookie with nonsense around it
            dev.send(bytes(junk))
            sent += 1
        expected = sent
        await eventually(
            lambda: channel.counters.get("rx_datagrams") == expected,  # noqa: B023
            what="the round",
        )
    # Junk with the live cookie may have moved the sequence (the header is not authenticated).
    dev.send(device_packet(key, nonce, b"still alive", session.last_uplink_seq + 1))
    await eventually(lambda: any(f.payload == b"still alive" for f in frames))
    assert channel.counters.get("rx_audio", 0) == len(frames)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_handle_datagram_never_raises(data: bytes) -> None:
    udp = UdpAudioChannel("127.0.0.1", 0, max_payload=1000)
    udp.open_session("dev", "s", lambda _frame: None)
    udp.handle_datagram(data, ("127.0.0.1", 9))
    assert udp.counters["rx_datagrams"] == 1


# ---- bounded logging ----------------------------------------------------------------------------


async def test_drops_log_a_few_lines_then_a_summary(
    channel: UdpAudioChannel, sockets: list[DeviceSocket]
) -> None:
    session, _frames = open_session(channel)
    key, nonce = hello_key_nonce(session)
    dev = DeviceSocket(channel.port)
    sockets.append(dev)
    replay = device_packet(key, nonce, b"a", 1)
    with structlog.testing.capture_logs() as logs:
        for _ in range(101):
            dev.send(replay)
        await eventually(lambda: channel.counters.get("drop_replay") == 100, what="100 replays")
        channel.close_session(session)
    lines = [line for line in logs if line["event"].startswith("udp datagram dropped")]
    assert [line["count"] for line in lines if "count" in line] == [1, 2, 3]
    summaries = [line for line in lines if line["event"].endswith("(repeated)")]
    assert len(summaries) == 1 and summaries[0]["repeated"] == 97
    assert summaries[0]["total"] == 100
    assert all(key.hex() not in str(line) for line in logs)  # the key never reaches a log


def test_rate_limited_log_summarises_per_interval() -> None:
    now = [0.0]
    with structlog.testing.capture_logs() as logs:
        limiter = EventBudget(
            structlog.get_logger(), "dropped", first=2, summary_interval_s=10, clock=lambda: now[0]
        )
        for _ in range(5):
            limiter.hit("replay")
        now[0] = 11.0
        limiter.hit("replay")  # a summary of the 4 since the last line
        limiter.hit("short")
        limiter.flush()
    events = [(line["event"], line.get("repeated", line.get("count"))) for line in logs]
    assert events == [
        ("dropped", 1),
        ("dropped", 2),
        ("dropped (repeated)", 4),
        ("dropped", 1),
    ]


def test_rate_limited_log_keys_are_bounded() -> None:
    with structlog.testing.capture_logs():
        limiter = EventBudget(structlog.get_logger(), "x", max_keys=3)
        for index in range(10):
            limiter.hit(f"peer-{index}")
    assert [limiter.count(f"peer-{index}") for index in range(10)] == [0] * 7 + [1] * 3


def test_a_failure_with_no_budget_left_spends_what_had_refilled() -> None:
    """As before the buckets were shared: a source that keeps failing stays out of budget."""
    budgets = SourceBudgets(UdpLimits(source_failures_per_s=1.0, source_burst=1.0))
    assert budgets.charge("10.0.0.9", 0.0)  # its one failure: the bucket is now empty
    assert not budgets.charge("10.0.0.9", 0.5)  # half a token had refilled: spent
    assert budgets.exhausted("10.0.0.9", 1.2)  # 0.7 s of refill since, not a whole token
    assert not budgets.exhausted("10.0.0.9", 1.5)
