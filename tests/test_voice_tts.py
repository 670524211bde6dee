"""Speech synthesis: the embedded eSpeak NG (real library, real resampling), the OpenAI-compatible
`/v1/audio/speech` provider against a loopback fake speaking the real wire format, the eSpeak
fallback when that provider is down, slow or broken, and the text hygiene before speech."""

import asyncio
import socket
import sys
from collections.abc import AsyncIterator, Iterator

import numpy
import pytest
from structlog.testing import capture_logs

from backend.config import Settings
from backend.voice import tts
from backend.voice.audio import Clip
from backend.voice.errors import SpeechFailed, VoiceUnavailable
from backend.voice.tts import (
    EspeakSynthesizer,
    FallbackSynthesizer,
    OpenAISpeech,
    Synthesizer,
    render,
    speakable,
    synthesizer_from_settings,
)
from tests.fakes.speech_server import FakeSpeechServer, SpeechReply

ENGLISH = "Please turn on the kitchen light and tell me the weather for tomorrow morning."
VIETNAMESE = "Bạn nên đánh răng hai lần mỗi ngày, mỗi lần hai phút."
LONG = " ".join([ENGLISH] * 3)
KEY = "sk-test-not-for-logs-123"


def rms(pcm: bytes) -> float:
    samples = numpy.frombuffer(pcm, dtype="<i2").astype(numpy.float64)
    return float(numpy.sqrt(numpy.mean(samples**2))) if len(samples) else 0.0


def ramp(samples: int) -> bytes:
    """Distinct 16-bit samples, so a byte lost or swapped anywhere shows."""
    return (numpy.arange(samples, dtype=numpy.int64) * 7 % 65536 - 32768).astype("<i2").tobytes()


def tone(seconds: float, rate: int = 24000) -> bytes:
    t = numpy.arange(int(seconds * rate)) / rate
    return (numpy.sin(2 * numpy.pi * 440 * t) * 8000).astype("<i2").tobytes()


async def collect(synthesizer: Synthesizer, text: str, language: str, rate: int) -> list[bytes]:
    return [chunk async for chunk in synthesizer.synthesize(text, language, rate)]


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more: connection refused


@pytest.fixture
def speech_server() -> Iterator[FakeSpeechServer]:
    server = FakeSpeechServer().start()
    yield server
    server.stop()


@pytest.fixture
async def espeak() -> AsyncIterator[EspeakSynthesizer]:
    synthesizer = EspeakSynthesizer()
    yield synthesizer
    await synthesizer.aclose()


# ---- eSpeak -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [16000, 24000])
@pytest.mark.parametrize(("text", "language"), [(ENGLISH, "en"), (VIETNAMESE, "vi")])
def test_espeak_renders_audible_speech_of_plausible_length(text: str, language: str, rate: int):
    clip = render(text, language, rate)
    words = len(text.split())
    expected_s = words / 175 * 60  # eSpeak's default 175 words per minute
    assert clip.sample_rate == rate
    assert len(clip.pcm) % 2 == 0
    assert 0.5 * expected_s < clip.duration_ms / 1000 < 2.0 * expected_s
    assert rms(clip.pcm) > 500  # speech, not silence (full scale is 32767)


def test_the_sample_count_follows_the_rate():
    at_16k = render(ENGLISH, "en", 16000)
    at_24k = render(ENGLISH, "en", 24000)
    # The same speech: the durations agree (eSpeak varies by a few ms between runs).
    assert at_24k.duration_ms == pytest.approx(at_16k.duration_ms, rel=0.03)
    assert len(at_24k.pcm) / len(at_16k.pcm) == pytest.approx(1.5, rel=0.03)


def spectral_distance(a: Clip, b: Clip) -> float:
    """How different two clips' long-term spectra are (0: same shape, 2: disjoint): 64 bands
    up to 4 kHz. Two renderings by one voice measure ~0.05-0.08 here, distinct voices > 0.35."""

    def spectrum(clip: Clip) -> numpy.ndarray:
        samples = numpy.frombuffer(clip.pcm, dtype="<i2").astype(numpy.float64)
        magnitudes = numpy.abs(numpy.fft.rfft(samples, n=1 << 16))
        bands = magnitudes[: 1 << 14].reshape(64, -1).sum(axis=1)
        return bands / bands.sum()

    return float(numpy.abs(spectrum(a) - spectrum(b)).sum())


def test_the_voice_follows_the_language():
    text = "An toan, an toan, an toan."
    english, vietnamese = render(text, "en", 16000), render(text, "vi", 16000)
    assert spectral_distance(english, render(text, "en", 16000)) < 0.15  # the yardstick
    assert spectral_distance(english, vietnamese) > 0.25


def test_two_english_voices_differ():
    american = render(ENGLISH, "en", 16000, voice="en-us")
    female = render(ENGLISH, "en", 16000, voice="en-us+f3")
    british = render(ENGLISH, "en", 16000, voice="en-gb")
    assert min(rms(american.pcm), rms(british.pcm), rms(female.pcm)) > 500
    assert spectral_distance(american, render(ENGLISH, "en", 16000, voice="en-us")) < 0.15
    assert spectral_distance(american, female) > 0.25


def test_speaking_rate_changes_the_duration():
    slow = render(ENGLISH, "en", 16000, words_per_minute=120)
    fast = render(ENGLISH, "en", 16000, words_per_minute=260)
    assert slow.duration_ms > 1.5 * fast.duration_ms


def test_an_unknown_voice_is_a_clear_error():
    with pytest.raises(VoiceUnavailable, match="no voice 'xx-nope'"):
        render("hello", "en", 16000, voice="xx-nope")


def test_a_missing_espeakng_loader_is_named(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "espeakng_loader", None)  # import fails as if absent
    with pytest.raises(VoiceUnavailable, match="espeakng-loader"):
        tts._Espeak().ensure_loaded()


async def test_a_long_sentence_streams_in_many_chunks(espeak: EspeakSynthesizer):
    chunks = await collect(espeak, LONG, "en", 24000)
    whole = b"".join(chunks)
    assert len(chunks) > 10  # about one per 60 ms of speech, not one blob at the end
    assert all(len(chunk) % 2 == 0 for chunk in chunks)
    assert len(whole) / 2 / 24000 > 8
    assert rms(whole) > 500


async def test_the_async_stream_matches_the_blocking_render(espeak: EspeakSynthesizer):
    streamed = b"".join(await collect(espeak, VIETNAMESE, "vi", 16000))
    rendered = render(VIETNAMESE, "vi", 16000)
    assert len(streamed) / 2 / 16000 == pytest.approx(rendered.duration_ms / 1000, rel=0.03)


async def test_concurrent_syntheses_neither_crash_nor_mix(espeak: EspeakSynthesizer):
    texts = [("Yes.", "en"), (ENGLISH, "en"), (VIETNAMESE, "vi"), (LONG, "en")]
    solo_s = {text: render(text, language, 16000).duration_ms / 1000 for text, language in texts}

    async def through_async(text: str, language: str) -> tuple[str, float]:
        pcm = b"".join(await collect(espeak, text, language, 16000))
        return text, len(pcm) / 2 / 16000

    async def through_thread(text: str, language: str) -> tuple[str, float]:
        clip = await asyncio.to_thread(render, text, language, 16000)  # other threads too
        return text, clip.duration_ms / 1000

    jobs = [
        maker(text, language)
        for _ in range(6)
        for text, language in texts
        for maker in (through_async, through_thread)
    ]
    for text, seconds in await asyncio.gather(*jobs):
        # Audio mixed between syntheses would change each one's length.
        assert seconds == pytest.approx(solo_s[text], rel=0.03), text


async def test_stopping_early_aborts_and_the_next_sentence_is_whole(espeak: EspeakSynthesizer):
    stream = espeak.synthesize(LONG, "en", 16000)
    first = await anext(stream)
    await stream.aclose()  # a barge-in: the consumer stops listening
    assert first
    after = b"".join(await collect(espeak, ENGLISH, "en", 16000))
    solo = render(ENGLISH, "en", 16000)
    assert len(after) / 2 / 16000 == pytest.approx(solo.duration_ms / 1000, rel=0.03)


async def test_a_synthesizer_with_another_voice():
    female = EspeakSynthesizer(voices={"en": "en-us+f3"})
    try:
        pcm = b"".join(await collect(female, ENGLISH, "en", 16000))
    finally:
        await female.aclose()
    streamed = Clip(pcm, 16000)
    assert spectral_distance(streamed, render(ENGLISH, "en", 16000, voice="en-us+f3")) < 0.15
    assert spectral_distance(streamed, render(ENGLISH, "en", 16000)) > 0.25


async def test_a_closed_synthesizer_says_so():
    espeak = EspeakSynthesizer()
    await espeak.aclose()
    with pytest.raises(VoiceUnavailable, match="closed"):
        await collect(espeak, "Hello.", "en", 16000)


# ---- OpenAI-compatible provider --------------------------------------------------------------


async def test_openai_speech_request_and_exact_pcm(speech_server: FakeSpeechServer):
    pcm = ramp(24000)  # one second at 24 kHz
    speech_server.script(SpeechReply(pcm=pcm, pieces=[1, 3, 1000, 4097, 2, 7]))
    remote = OpenAISpeech(
        speech_server.url, api_key=KEY, model="kokoro", voice="af_sky", speed=1.25, timeout_s=5
    )
    try:
        chunks = await collect(remote, "Hello there.", "en", 24000)
    finally:
        await remote.aclose()
    assert b"".join(chunks) == pcm  # odd pieces reassembled into whole samples, nothing lost
    assert all(len(chunk) % 2 == 0 for chunk in chunks)
    assert len(chunks) > 1  # yielded as it arrived
    (request,) = speech_server.requests
    assert request.path == "/v1/audio/speech"
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.body == {
        "model": "kokoro",
        "input": "Hello there.",
        "voice": "af_sky",
        "response_format": "pcm",
        "speed": 1.25,
    }


async def test_openai_speech_without_a_key_sends_no_authorization(
    speech_server: FakeSpeechServer,
):
    speech_server.script(SpeechReply(pcm=ramp(100)))
    remote = OpenAISpeech(speech_server.url + "/v1")  # a base that already ends in /v1
    try:
        await collect(remote, "Hi.", "en", 24000)
    finally:
        await remote.aclose()
    (request,) = speech_server.requests
    assert request.path == "/v1/audio/speech"
    assert "authorization" not in request.headers


async def test_openai_speech_resamples_24k_to_16k(speech_server: FakeSpeechServer):
    speech_server.script(SpeechReply(pcm=tone(1.5), pieces=[4801, 9599, 3]))
    remote = OpenAISpeech(speech_server.url)
    try:
        pcm = b"".join(await collect(remote, "Hi.", "en", 16000))
    finally:
        await remote.aclose()
    assert len(pcm) / 2 / 16000 == pytest.approx(1.5, abs=0.01)
    assert rms(pcm) == pytest.approx(rms(tone(1.5)), rel=0.05)


@pytest.mark.parametrize(("wav_rate", "out_rate"), [(24000, 24000), (22050, 16000)])
async def test_openai_speech_accepts_a_streamed_wav(
    speech_server: FakeSpeechServer, wav_rate: int, out_rate: int
):
    pcm = ramp(wav_rate) if wav_rate == out_rate else tone(1.0, wav_rate)
    # Pieces that split the header itself, the odd LIST chunk and the first sample.
    speech_server.script(SpeechReply(pcm=pcm, wav=True, rate=wav_rate, pieces=[5, 30, 22, 1, 3]))
    remote = OpenAISpeech(speech_server.url)
    try:
        out = b"".join(await collect(remote, "Hi.", "en", out_rate))
    finally:
        await remote.aclose()
    if wav_rate == out_rate:
        assert out == pcm
    else:
        assert len(out) / 2 / out_rate == pytest.approx(1.0, abs=0.01)


async def test_openai_speech_errors_name_the_status_never_the_key(
    speech_server: FakeSpeechServer,
):
    speech_server.script(SpeechReply(status=500))
    remote = OpenAISpeech(speech_server.url, api_key=KEY)
    try:
        with pytest.raises(SpeechFailed, match="HTTP 500") as failure:
            await collect(remote, "Hi.", "en", 24000)
    finally:
        await remote.aclose()
    assert KEY not in str(failure.value)


# ---- fallback -----------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fallback_to_espeak(
    url: str, timeout_s: float = 5.0, clock: Clock | None = None, retry_after_s: float = 30.0
) -> FallbackSynthesizer:
    remote = OpenAISpeech(url, api_key=KEY, timeout_s=timeout_s)
    return FallbackSynthesizer(
        remote, EspeakSynthesizer(), clock=clock or Clock(), retry_after_s=retry_after_s
    )


def failures(logs: list[dict]) -> list[dict]:
    return [entry for entry in logs if entry["event"] == "tts.provider_failed"]


async def assert_espeak_spoke(synthesizer: FallbackSynthesizer, text: str = ENGLISH) -> None:
    pcm = b"".join(await collect(synthesizer, text, "en", 16000))
    solo = render(text, "en", 16000)
    assert len(pcm) / 2 / 16000 == pytest.approx(solo.duration_ms / 1000, rel=0.03)
    assert rms(pcm) > 500


async def test_connection_refused_falls_back_to_espeak_and_logs_once():
    # retry_after_s=0: every sentence asks the dead server again; still one log line.
    synthesizer = fallback_to_espeak(closed_port_url(), retry_after_s=0)
    try:
        with capture_logs() as logs:
            await assert_espeak_spoke(synthesizer)
            await assert_espeak_spoke(synthesizer, "And a second sentence.")
            await assert_espeak_spoke(synthesizer, "And a third one.")
    finally:
        await synthesizer.aclose()
    (failure,) = failures(logs)
    assert failure["log_level"] == "warning"
    assert "ConnectError" in failure["reason"]
    assert failure["fallback"] == "espeak"
    assert KEY not in repr(logs)


async def test_http_500_falls_back_and_a_recovery_is_logged(speech_server: FakeSpeechServer):
    clock = Clock()
    synthesizer = fallback_to_espeak(speech_server.url, clock=clock)
    speech_server.script(SpeechReply(status=500))
    try:
        with capture_logs() as logs:
            await assert_espeak_spoke(synthesizer)
            await assert_espeak_spoke(synthesizer)  # within the retry interval: not asked
            assert len(speech_server.requests) == 1
            clock.now += synthesizer.retry_after_s
            speech_server.script(SpeechReply(pcm=ramp(4800)))
            remote = b"".join(await collect(synthesizer, "Back.", "en", 24000))
    finally:
        await synthesizer.aclose()
    assert remote == ramp(4800)
    (failure,) = failures(logs)
    assert "HTTP 500" in failure["reason"]
    (recovered,) = [entry for entry in logs if entry["event"] == "tts.provider_recovered"]
    assert recovered["sentences_by_fallback"] == 2
    assert not synthesizer.primary_down


async def test_a_slow_server_times_out_into_espeak(speech_server: FakeSpeechServer):
    speech_server.script(SpeechReply(pcm=ramp(4800), delay_s=30))
    synthesizer = fallback_to_espeak(speech_server.url, timeout_s=0.3)
    try:
        with capture_logs() as logs:
            await assert_espeak_spoke(synthesizer)
    finally:
        await synthesizer.aclose()
    (failure,) = failures(logs)
    assert "Timeout" in failure["reason"]


async def test_a_failure_mid_sentence_ends_that_sentence(speech_server: FakeSpeechServer):
    speech_server.script(SpeechReply(pcm=ramp(24000), pieces=[4800, 4800, 4800], cut_after=2))
    synthesizer = fallback_to_espeak(speech_server.url)
    try:
        with capture_logs() as logs:
            pcm = b"".join(await collect(synthesizer, "Cut short.", "en", 24000))
    finally:
        await synthesizer.aclose()
    assert pcm == ramp(24000)[:9600]  # what arrived, then silence: no eSpeak restart
    (failure,) = failures(logs)
    assert failure["mid_sentence"] is True


# ---- configuration -------------------------------------------------------------------------------


async def test_synthesizer_from_settings(tmp_path):
    def settings(**values: object) -> Settings:
        return Settings.on_loopback(tmp_path, **values)

    assert synthesizer_from_settings(settings(tts_provider="none")) is None
    embedded = synthesizer_from_settings(settings(tts_provider="embedded"))
    assert isinstance(embedded, EspeakSynthesizer)
    remote = synthesizer_from_settings(
        settings(tts_provider="openai", tts_base_url="http://127.0.0.1:9", tts_api_key=KEY)
    )
    assert isinstance(remote, FallbackSynthesizer)
    assert isinstance(remote.primary, OpenAISpeech) and remote.primary.url.endswith("/speech")
    assert isinstance(remote.fallback, EspeakSynthesizer)
    for synthesizer in (embedded, remote):
        assert synthesizer is not None
        await synthesizer.aclose()


# ---- what is read aloud -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "spoken"),
    [
        ("See [the guide](https://example.com/a_(b)) for more [1].", "See the guide for more."),
        (
            "Brush **twice** a day[2][3]. Details: https://www.ada.org/x?y=1.",
            "Brush twice a day. Details.",
        ),
        ("Visit www.mouthhealthy.org today.", "Visit today."),
        ("Read <https://x.example/a> now [4, 5].", "Read now."),
        ("# Flossing\n- once *a day*\n- gently", "Flossing. once a day. gently."),
        ("Use `fluoride` paste, my_snake_case stays.", "Use fluoride paste, my_snake_case stays."),
        ("Răng [1] (https://vi.wikipedia.org/wiki/Răng) khỏe.", "Răng khỏe."),
    ],
)
def test_speakable_strips_urls_markdown_and_citations(text: str, spoken: str):
    assert speakable(text) == spoken
