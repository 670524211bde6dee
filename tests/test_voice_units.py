"""The voice loop's small parts on their own: the playout clock, the silero pool, the speech
detector, the codecs."""

import numpy as np
import pytest

from backend.protocol import AudioParams, downlink_params
from backend.voice.audio import split_frames
from backend.voice.codec import downlink_encoder, uplink_decoder
from backend.voice.errors import AudioDecodeError
from backend.voice.playout import PlayoutClock
from backend.voice.tts import render
from backend.voice.vad import SileroPool, SpeechDetector, VadEvent
from tests.helpers import eventually

FRAME = 0.06


def test_the_clock_sends_lead_frames_at_once_then_one_per_frame():
    clock = PlayoutClock(FRAME, lead=2)
    sends = []
    for _ in range(6):
        at = clock.send_at(100.0)
        sends.append(round(at - 100.0, 3))
        clock.mark_sent(max(at, 100.0))
    assert sends == [-0.12, -0.06, 0.0, 0.06, 0.12, 0.18]  # 3 at once, then paced
    assert clock.last_due == pytest.approx(100.0 + 6 * FRAME)


def test_a_late_send_rebases_the_clock_so_the_stop_is_not_early():
    clock = PlayoutClock(FRAME, lead=2)
    for _ in range(3):
        clock.mark_sent(clock.send_at(0.0) if clock.send_at(0.0) > 0 else 0.0)
    # The loop overslept: frame 3, due at 0.18, leaves at 0.50 (the device ran dry at 0.18).
    clock.send_at(0.10)
    clock.mark_sent(0.50)
    assert clock.last_due == pytest.approx(0.50 + FRAME)  # not 0.24: the device plays it late


async def test_the_pool_loads_one_model_off_the_loop_and_lends_cheap_streams():
    pool = SileroPool(size=10)
    try:
        assert pool.acquire() is None  # cold: nothing is loaded on the caller's thread
        await eventually(lambda: pool.ready)
        streams = [pool.acquire() for _ in range(3)]
        assert all(stream is not None for stream in streams) and pool.lent == 3
        for stream in streams:
            assert stream is not None
            pool.release(stream)
        assert pool.lent == 0
    finally:
        pool.close()


async def test_the_pool_never_lends_more_than_its_size():
    pool = SileroPool(size=1)
    try:
        pool.warm()
        await eventually(lambda: pool.ready)
        assert pool.acquire() is not None
        assert pool.acquire() is None and pool.lent == 1
    finally:
        pool.close()


async def test_streams_of_one_model_keep_their_own_state():
    """Two speakers at once on the shared model score exactly as each would alone."""
    pool = SileroPool(size=2)
    try:
        pool.warm()
        await eventually(lambda: pool.ready)
        speech = np.frombuffer(render("turn on the light", "en", 16000).pcm, dtype=np.int16)
        windows = (speech[: len(speech) // 512 * 512].astype(np.float32) / 32768).reshape(-1, 512)
        quiet = np.zeros_like(windows)
        alone = pool.acquire()
        assert alone is not None
        expected = [alone.process(w) for w in windows]
        pool.release(alone)
        first, second = pool.acquire(), pool.acquire()
        assert first is not None and second is not None
        together = []
        for window, other in zip(windows, quiet, strict=True):
            together.append(first.process(window))
            second.process(other)
        assert together == expected and max(expected) > 0.9
        first.reset()
        assert [first.process(w) for w in windows] == expected
    finally:
        pool.close()


async def test_the_detector_finds_speech_and_its_end_and_ignores_silence():
    pool = SileroPool(size=4)
    try:
        pool.warm()
        await eventually(lambda: pool.ready)
        detector = SpeechDetector(600, pool)
        speech = render("set the volume to thirty", "en", 16000).pcm
        events = _feed(detector, bytes(32000) + speech + bytes(48000))
        assert [event for _, event in events] == [VadEvent.SPEECH_START, VadEvent.SPEECH_END]
        start_ms, end_ms = (at for at, _ in events)
        assert 900 <= start_ms <= 1400  # speech starts at 1000 ms
        speech_end = 1000 + len(speech) / 32  # 32 bytes a millisecond
        assert speech_end < end_ms < speech_end + 1500
        assert pool.lent == 0 and not detector.degraded
        assert _feed(detector, bytes(64000)) == []
    finally:
        pool.close()


async def test_without_a_free_model_the_gate_decides_alone():
    pool = SileroPool(size=1, load=False)  # no model ever
    try:
        detector = SpeechDetector(600, pool)
        speech = render("set the volume to thirty", "en", 16000).pcm
        events = _feed(detector, bytes(16000) + speech + bytes(48000))
        assert [event for _, event in events] == [VadEvent.SPEECH_START, VadEvent.SPEECH_END]
        assert detector.degraded
    finally:
        pool.close()


def test_uplink_decoders_refuse_what_they_cannot_use():
    opus = uplink_decoder(AudioParams(format="opus"))
    with pytest.raises(AudioDecodeError):
        opus.decode(b"")
    pcm = uplink_decoder(AudioParams(format="pcm16", sample_rate=16000))
    with pytest.raises(AudioDecodeError, match="not whole samples"):
        pcm.decode(b"\x00\x01\x02")
    with pytest.raises(AudioDecodeError, match="over 120 ms"):
        pcm.decode(bytes(16000 * 2))
    with pytest.raises(AudioDecodeError, match="not supported"):
        uplink_decoder(AudioParams(format="mp3"))


def test_opus_downlink_round_trips_at_the_announced_rate():
    encoder = downlink_encoder(AudioParams(format="opus", sample_rate=24000))
    tone = (np.sin(np.arange(1440) * 2 * np.pi * 440 / 24000) * 8000).astype(np.int16).tobytes()
    packet = encoder.encode(tone)
    import opuslib_next

    decoded = opuslib_next.Decoder(24000, 1).decode(packet, 1440)
    assert len(decoded) == len(tone)


def _feed(detector: SpeechDetector, pcm: bytes) -> list[tuple[int, VadEvent]]:
    events = []
    for index, frame in enumerate(split_frames(pcm, 16000)):
        event = detector.feed(frame)
        if event is not None:
            events.append((index * 60, event))
    return events


@pytest.mark.parametrize(
    ("uplink", "announced"),
    [
        ({}, ("opus", 24000)),
        ({"format": "pcm16"}, ("pcm16", 16000)),
        ({"format": "pcm16", "downlink_sample_rate": 24000}, ("pcm16", 24000)),
        ({"downlink_sample_rate": 16000}, ("opus", 16000)),
        # Hostile or odd requests get the default, never an unplayable rate or a crash.
        ({"downlink_sample_rate": 7}, ("opus", 24000)),
        ({"downlink_sample_rate": 10**9}, ("opus", 24000)),
        ({"downlink_sample_rate": "16000"}, ("opus", 24000)),
        ({"downlink_sample_rate": True}, ("opus", 24000)),
        ({"format": "pcm16", "downlink_sample_rate": 44100}, ("pcm16", 16000)),
        ({"format": "mp3"}, ("opus", 24000)),
    ],
)
def test_the_server_hello_announces_a_playable_downlink(uplink, announced):
    params = downlink_params(AudioParams(**uplink), opus_rate=24000, frame_duration=60)
    assert (params.format, params.sample_rate, params.frame_duration) == (*announced, 60)
