"""Speech recognition: the embedded pocketsphinx stack on synthesized speech through the device's
Opus path, the phrases its grammar is built from, the OpenAI-compatible transcriber against a
loopback server speaking the real multipart format, and the fallback between them."""

import array
import asyncio
import random
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import pytest
import structlog

from backend.config import Settings
from backend.mcp_session import Tool
from backend.voice.asr import (
    FallbackRecognizer,
    OpenAITranscriber,
    PocketsphinxRecognizer,
    RecognitionHints,
    Recognizer,
    Transcript,
    command_phrases,
    recognizer_from_settings,
)
from backend.voice.asr_phrases import spoken_numbers_to_digits
from backend.voice.asr_worker import Hyp, Word, choose, without_unsure_units
from backend.voice.audio import UPLINK_RATE, frame_bytes, read_wav
from backend.voice.tts import render
from simulator.in_process import FirmwareDevice
from tests.asr_helpers import (
    VOICES,
    RoutingJudge,
    Utterance,
    device_path_frames,
    render_fresh,
)
from tests.fakes.transcription_server import FakeTranscriptionServer, TranscriptionReply

pytest.importorskip("pocketsphinx")
pytest.importorskip("opuslib_next")

COMMANDS = [
    "set the volume to thirty",
    "set the volume to seventy five",
    "volume twenty",
    "turn the volume up",
    "turn the volume down",
    "mute the speaker",
    "set the volume to maximum",
    "set the brightness to fifty",
    "set the screen brightness to eighty",
    "brightness ten",
    "turn on the light",
    "turn off the light",
    "switch the led off",
    "switch to dark mode",
    "use the light theme",
    "what is the device status",
    "please set the volume to forty",
]
DENTAL = [
    "how often should I floss",
    "why do my gums bleed",
    "what is a root canal",
    "how often should I brush my teeth",
    "what causes bad breath",
    "is teeth whitening safe",
    "what should I do if a tooth gets knocked out",
    "how long does orthodontic treatment with braces take",
    "what causes cavities",
    "how do I treat sensitive teeth",
    "when should I replace my toothbrush",
    "what is gingivitis",
    "how often should I see the dentist",
    "what are dental implants",
    "how do I stop grinding my teeth",
    "should I get my wisdom teeth removed",
    "what causes a dry mouth",
]
RECOGNITION_SET = [Utterance(t, "command") for t in COMMANDS] + [
    Utterance(t, "dental") for t in DENTAL
]
TARGET = 0.90


@pytest.fixture(scope="module")
def hints() -> RecognitionHints:
    return RecognitionHints(command_phrases(FirmwareDevice().tool_list(include_user_only=False)))


@pytest.fixture(scope="module")
def sphinx() -> Iterator[PocketsphinxRecognizer]:
    recognizer = PocketsphinxRecognizer()
    yield recognizer
    asyncio.run(recognizer.aclose())


async def recognize(
    recognizer: Recognizer,
    hints: RecognitionHints,
    frames: list[bytes],
) -> Transcript:
    stream = recognizer.open(hints)
    for frame in frames:
        stream.feed(frame)
    return await stream.finish()


@pytest.fixture(scope="module")
def recognition_results(
    sphinx: PocketsphinxRecognizer, hints: RecognitionHints
) -> list[tuple[str, Utterance, Transcript]]:
    cases = [(voice, utterance) for voice in VOICES for utterance in RECOGNITION_SET]
    speech = render_fresh([(utterance.text, voice) for voice, utterance in cases])

    async def run_all() -> list[tuple[str, Utterance, Transcript]]:
        results = []
        for (voice, utterance), pcm in zip(cases, speech, strict=True):
            frames = device_path_frames(pcm)
            results.append((voice, utterance, await recognize(sphinx, hints, frames)))
        return results

    return asyncio.run(run_all())


# ---- the recognition set ---------------------------------------------------------------------


def test_the_recognition_set_is_routed_right(
    recognition_results: list[tuple[str, Utterance, Transcript]],
) -> None:
    judge = RoutingJudge()
    right: Counter[tuple[str, str]] = Counter()
    total: Counter[tuple[str, str]] = Counter()
    wrong = []
    for voice, utterance, transcript in recognition_results:
        key = (voice, utterance.category)
        total[key] += 1
        if judge.routed_right(utterance, transcript.text):
            right[key] += 1
        else:
            wrong.append((voice, utterance.text, transcript.text, transcript.engine))
    for key in sorted(total):
        print(f"{key[0]:9} {key[1]:8} {right[key]}/{total[key]}")
    print("misses:", *wrong, sep="\n  ")
    assert len(RECOGNITION_SET) >= 30
    share = sum(right.values()) / sum(total.values())
    assert share >= TARGET, wrong


def test_commands_in_the_grammar_decode_to_the_exact_phrase(
    recognition_results: list[tuple[str, Utterance, Transcript]],
) -> None:
    exact = [
        (utterance.text, transcript.text)
        for _voice, utterance, transcript in recognition_results
        if utterance.text == "set the volume to thirty"
    ]
    assert exact == [("set the volume to thirty", "set the volume to 30")] * len(VOICES)
    engines = {t.engine for _v, u, t in recognition_results if u.text == "turn on the light"}
    assert engines == {"pocketsphinx-grammar"}


def with_noise_floor(frames: list[bytes], lead: int, tail: int, seed: int) -> list[bytes]:
    """`frames` after `lead` and before `tail` frames of silence, under a microphone's noise
    floor (Gaussian, sigma 30 of 32768: about -60 dBFS)."""
    rng = random.Random(seed)
    silence = bytes(frame_bytes(UPLINK_RATE))
    noisy = []
    for frame in [silence] * lead + frames + [silence] * tail:
        samples = array.array("h", frame)
        for i, sample in enumerate(samples):
            samples[i] = max(-32768, min(32767, sample + round(rng.gauss(0, 30))))
        noisy.append(samples.tobytes())
    return noisy


NUMBER_COMMANDS = ["set the volume to thirty", "set the volume to sixty", "volume twenty"]


def test_a_command_decodes_the_same_wherever_it_is_cut_and_whatever_the_decoder_heard_before(
    hints: RecognitionHints,
) -> None:
    """Streamed with a running cepstral mean, the grammar read a fresh decoder's bare tens as
    "<tens> eight" a quarter of the time and drifted with what it had decoded before, so the
    same turn decoded differently run to run. A noise floor made it read noise after "thirty"
    as a units word."""

    async def run() -> list[tuple[str, str]]:
        results = []
        for text in [*NUMBER_COMMANDS, "set the volume to thirty eight"]:
            frames = device_path_frames(render(text, voice="en-us").pcm)
            expected = spoken_numbers_to_digits(text)
            for seed, (lead, tail) in enumerate([(0, 0), (0, 3), (4, 2), (9, 1)]):
                fresh = PocketsphinxRecognizer()  # no history: the first utterance of a worker
                try:
                    noisy = with_noise_floor(frames, lead, tail, seed)
                    heard = (await recognize(fresh, hints, noisy)).text
                finally:
                    await fresh.aclose()
                results.append((expected, heard))
        return results

    results = asyncio.run(run())
    assert [heard for _expected, heard in results] == [expected for expected, _ in results]


def test_a_short_units_word_the_decoder_is_unsure_of_is_dropped() -> None:
    def words(*units: tuple[str, float, int]) -> list[Word]:
        return [Word("<sil>", 1.0, 20), Word("volume", 1.0, 40), Word("thirty", 1.0, 35)] + [
            Word(text, prob, frames) for text, prob, frames in units
        ]

    assert without_unsure_units("volume thirty eight", words(("eight", 0.6, 22))) == (
        "volume thirty"
    )
    assert without_unsure_units("volume thirty eight", words(("eight", 1.0, 22))) == (
        "volume thirty eight"
    )
    long_unsure = words(("eight", 0.5, 53), ("</s>", 1.0, 1))
    assert without_unsure_units("volume thirty eight", long_unsure) == "volume thirty eight"
    assert without_unsure_units("volume thirty", words()) == "volume thirty"
    not_units = [Word("turn", 0.5, 10), Word("on", 0.5, 10)]
    assert without_unsure_units("turn on", not_units) == "turn on"


@pytest.mark.parametrize(
    "text", ["who won the football match last night", "recommend a good movie to watch tonight"]
)
def test_speech_outside_the_grammar_is_not_forced_onto_a_phrase(
    text: str, sphinx: PocketsphinxRecognizer, hints: RecognitionHints
) -> None:
    frames = device_path_frames(render(text, voice="en-us").pcm)
    transcript = asyncio.run(recognize(sphinx, hints, frames))
    assert transcript.engine == "pocketsphinx-lm"
    assert transcript.text not in {p for p in hints.phrases}


def test_silence_gives_no_text(sphinx: PocketsphinxRecognizer, hints: RecognitionHints) -> None:
    transcript = asyncio.run(recognize(sphinx, hints, [bytes(frame_bytes(UPLINK_RATE))] * 10))
    assert transcript.text == ""


def test_choice_takes_a_whole_grammar_phrase_that_scores_or_that_the_lm_heard() -> None:
    partial = Hyp("show the", 0.8, complete=False)  # the grammar search's best partial path
    assert choose(partial, Hyp("so but it's my wisdom teeth removed", 0.4))[1] == (
        "pocketsphinx-lm"
    )
    assert choose(Hyp("turn on the light", 0.8), None) == (
        "turn on the light",
        "pocketsphinx-grammar",
    )
    forced = Hyp("mute the volume", 0.5)  # "please set the volume to forty" forced on a phrase
    assert choose(forced, Hyp("please set the volume to forty", 0.4))[1] == "pocketsphinx-lm"
    low = Hyp("turn the volume up", 0.5)
    assert choose(low, Hyp("please do the volume up", 0.4))[1] == "pocketsphinx-grammar"
    assert choose(None, None) == ("", "pocketsphinx-lm")


# ---- phrases -----------------------------------------------------------------------------------


def test_phrases_come_from_tool_schemas_the_router_and_the_knowledge_base(
    hints: RecognitionHints,
) -> None:
    phrases = set(hints.phrases)
    assert "set the volume to <number>" in phrases  # integer volume 0..100
    assert "set the screen brightness to <number>" in phrases  # the tool's name says screen
    assert {"turn on the led", "turn off the light", "switch the lamp on"} <= phrases  # boolean
    assert {"switch to dark mode", "use the light theme"} <= phrases  # quoted choices
    assert "what is the device status" in phrases  # a no-argument getter
    assert "switch to night mode" in phrases  # the offline router's lexicon
    assert {"what is a root canal", "how often should i floss"} <= phrases  # dental
    assert not any(
        w in p.split() for p in phrases for w in ("den", "luong", "rang")
    )  # no folded vi


def test_phrases_follow_an_unknown_tool_generically() -> None:
    fan = Tool(
        name="self.fan.set_speed",
        description="Set the fan speed (0-100).",
        inputSchema={"type": "object", "properties": {"speed": {"type": "integer"}}},
    )
    phrases = command_phrases([fan])
    assert {"set the speed to <number>", "set the fan speed to <number>"} <= set(phrases)
    assert phrases == command_phrases([fan])  # stable: grammars are cached by the tuple


def test_spoken_numbers_become_digits_the_router_reads() -> None:
    assert spoken_numbers_to_digits("set the volume to seventy five") == "set the volume to 75"
    assert spoken_numbers_to_digits("brightness one hundred") == "brightness 100"
    assert spoken_numbers_to_digits("brush at one other time") == "brush at 1 other time"
    assert spoken_numbers_to_digits("one tooth hurts") == "one tooth hurts"


# ---- bounds and cancel -------------------------------------------------------------------------


async def test_feeding_past_the_bound_is_ignored(hints: RecognitionHints) -> None:
    server = FakeTranscriptionServer().start()
    server.default = TranscriptionReply(text="ok")
    transcriber = OpenAITranscriber(server.url, max_utterance_s=2.0)
    try:
        stream = transcriber.open(hints)
        frame = bytes(range(256)) * (frame_bytes(UPLINK_RATE) // 256)
        for _ in range(100):  # 6 s of audio
            stream.feed(frame)
        await stream.finish()
    finally:
        await transcriber.aclose()
        server.stop()
    clip = read_wav(server.requests[0].file)
    assert clip.duration_ms == 2000


async def test_cancel_leaves_no_stream_thread_or_task(hints: RecognitionHints) -> None:
    before = set(threading.enumerate())
    recognizer = PocketsphinxRecognizer()
    try:
        await recognizer.warm(hints)
        threads = set(threading.enumerate())
        tasks = asyncio.all_tasks()
        frames = device_path_frames(render("set the volume to thirty").pcm)
        for _ in range(3):
            stream = recognizer.open(hints)
            for frame in frames:
                stream.feed(frame)
            stream.cancel()
        assert (await recognizer.stats())[0] == 0  # the worker holds no stream
        assert set(threading.enumerate()) == threads
        assert asyncio.all_tasks() == tasks
        transcript = await recognize(recognizer, hints, frames)  # the decoders are reusable
        assert transcript.text == "set the volume to 30"
    finally:
        await recognizer.aclose()
    assert {t for t in threading.enumerate() if t.name.startswith("asr-")} <= before


async def test_cancel_stops_a_transcription_in_flight(hints: RecognitionHints) -> None:
    server = FakeTranscriptionServer().start()
    server.default = TranscriptionReply(text="late", delay_s=30)
    transcriber = OpenAITranscriber(server.url)
    try:
        stream = transcriber.open(hints)
        stream.feed(bytes(frame_bytes(UPLINK_RATE)))
        tasks = asyncio.all_tasks()
        pending = asyncio.ensure_future(stream.finish())
        assert await asyncio.to_thread(server.received.wait, 10)
        stream.cancel()
        transcript = await pending
        assert transcript.text == "" and transcript.fallback_reason == "cancelled"
        assert asyncio.all_tasks() <= tasks
    finally:
        await transcriber.aclose()
        server.stop()


# ---- OpenAI-compatible transcriber -------------------------------------------------------------


@pytest.fixture
async def fake_server() -> AsyncIterator[FakeTranscriptionServer]:
    server = FakeTranscriptionServer().start()
    yield server
    server.stop()


async def test_openai_sends_the_utterance_as_a_wav_with_model_language_and_key(
    fake_server: FakeTranscriptionServer,
) -> None:
    fake_server.default = TranscriptionReply(text=" Tôi nên đánh răng bao lâu? ")
    transcriber = OpenAITranscriber(
        fake_server.url + "/v1", model="whisper-large", api_key="sk-test", language="vi"
    )
    pcm = render("hello there").pcm
    frames = [pcm[i : i + 1920] for i in range(0, len(pcm), 1920)]
    try:
        transcript = await recognize(transcriber, RecognitionHints(), frames)
    finally:
        await transcriber.aclose()
    assert transcript == Transcript("Tôi nên đánh răng bao lâu?", "openai", "vi")
    request = fake_server.requests[0]
    assert request.path == "/v1/audio/transcriptions"
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.fields == {"model": "whisper-large", "language": "vi", "response_format": "json"}
    assert request.file_type == "audio/wav" and request.file_name.endswith(".wav")
    clip = read_wav(request.file)
    assert (clip.sample_rate, clip.pcm) == (UPLINK_RATE, pcm)


async def test_openai_without_language_or_key_sends_neither(
    fake_server: FakeTranscriptionServer,
) -> None:
    transcriber = OpenAITranscriber(fake_server.url)
    try:
        await recognize(transcriber, RecognitionHints(), [bytes(1920)])
    finally:
        await transcriber.aclose()
    assert "language" not in fake_server.requests[0].fields
    assert "authorization" not in fake_server.requests[0].headers


def fallback_cases() -> list[tuple[str, TranscriptionReply | None, str]]:
    return [
        ("refused", None, "ConnectError"),
        ("http 500", TranscriptionReply(status=500, raw=b"oops"), "HTTP 500"),
        ("slow", TranscriptionReply(text="too late", delay_s=5), "no answer within 0.5 s"),
        ("garbage", TranscriptionReply(raw=b"<html>not json"), "not JSON"),
        ("no text", TranscriptionReply(raw=b'{"txt": 1}'), "not JSON with a 'text'"),
    ]


@pytest.mark.parametrize(("case", "reply", "reason"), fallback_cases())
async def test_a_failing_provider_falls_back_to_the_embedded_recognizer(
    case: str,
    reply: TranscriptionReply | None,
    reason: str,
    sphinx: PocketsphinxRecognizer,
    hints: RecognitionHints,
    fake_server: FakeTranscriptionServer,
) -> None:
    if reply is None:
        fake_server.stop()  # nothing listens on the port any more
    else:
        fake_server.default = reply
    remote = OpenAITranscriber(fake_server.url, api_key="sk-secret", timeout_s=0.5)
    recognizer = FallbackRecognizer(remote, sphinx)
    frames = device_path_frames(render("turn off the light").pcm)
    try:
        with structlog.testing.capture_logs() as logs:
            first = await recognize(recognizer, hints, frames)
            second = await recognize(recognizer, hints, frames)
    finally:
        await remote.aclose()
    assert first.text == second.text == "turn off the light"
    assert first.engine == "pocketsphinx-grammar"
    assert first.fallback_reason is not None and reason in first.fallback_reason
    outages = [entry for entry in logs if entry["event"] == "asr_provider_down"]
    assert len(outages) == 1 and reason in outages[0]["reason"]  # once per outage
    assert "sk-secret" not in repr(logs)


async def test_the_provider_coming_back_ends_the_outage(
    sphinx: PocketsphinxRecognizer, hints: RecognitionHints, fake_server: FakeTranscriptionServer
) -> None:
    fake_server.replies.extend(
        [
            TranscriptionReply(status=503),
            TranscriptionReply(text="hello"),
            TranscriptionReply(status=503),
        ]
    )
    remote = OpenAITranscriber(fake_server.url)
    recognizer = FallbackRecognizer(remote, sphinx)
    try:
        with structlog.testing.capture_logs() as logs:
            results = [await recognize(recognizer, hints, [bytes(1920)] * 5) for _ in range(3)]
    finally:
        await remote.aclose()
    assert [r.engine for r in results][1] == "openai"
    assert results[1].fallback_reason is None
    events = [entry["event"] for entry in logs if entry["event"].startswith("asr_provider")]
    assert events == ["asr_provider_down", "asr_provider_back", "asr_provider_down"]


# ---- configuration -----------------------------------------------------------------------------


async def test_recognizer_from_settings() -> None:
    assert recognizer_from_settings(Settings(asr_provider="none")) is None
    embedded = recognizer_from_settings(Settings(asr_provider="embedded"))
    assert isinstance(embedded, PocketsphinxRecognizer)
    remote = recognizer_from_settings(
        Settings(asr_provider="openai", asr_base_url="http://127.0.0.1:9", asr_api_key="k")
    )
    assert isinstance(remote, FallbackRecognizer)
    assert remote.primary.url == "http://127.0.0.1:9/v1/audio/transcriptions"
    await embedded.aclose()
    await remote.aclose()


def test_a_missing_pocketsphinx_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from backend.voice.errors import VoiceUnavailable

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "pocketsphinx" else real(name, *a),
    )
    with pytest.raises(VoiceUnavailable, match="pocketsphinx"):
        recognizer_from_settings(Settings(asr_provider="embedded"))
