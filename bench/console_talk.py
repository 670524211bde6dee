"""Benchmark: the talk page, end of speech in the browser to the first audio played.

One process: a real `Bridge` with the embedded voice stack (Whisper tiny.en in its decoding
process, the offline chat, eSpeak NG) and headless Chromium driven by Playwright. Chromium's
fake microphone plays a WAV of "set the volume to thirty" (1 s of silence, the command, 5 s of
silence, looped); the talk page (backend/console/static/talk.js) holds it in hands-free mode:
`listen start` auto, Opus 16 kHz 60 ms frames from WebCodecs, the bridge's VAD ends the
utterance, the answer comes back as Opus at 24 kHz, decoded by WebCodecs and scheduled on a Web
Audio clock. Each turn is timed by
the page (`window.talkStats`, `performance.now()`):

- **speech end**: when the last 60 ms frame louder than -40 dBFS reached the page's main thread
  from the AudioWorklet (it is encoded and sent at once);
- **first frame**: when the answer's first binary message arrived;
- **first audio played**: the time the page scheduled that frame to start on the audio clock
  (decode, then `PLAYBACK_LEAD_S` = 50 ms of jitter room).

Only turns whose transcript is the command count (the looping file is sometimes caught in the
middle on the first pass). **Baseline**, in the same run and on the same bridge: the Python
stock voice device (`simulator.voice_client.VoiceDevice`, Opus from libopus, the same eSpeak
speech at 16 kHz sent in real time over the device WebSocket, auto mode), speech end = when its last
frame louder than -40 dBFS left, first audio = its first downlink frame's arrival (its
playback model plays a frame on arrival). The ratio shows what the browser itself adds.
"""

import asyncio
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from playwright.async_api import Page, async_playwright

from bench.common import (
    DEVICE_TOKEN,
    Stats,
    bench_main,
    quiet_logging,
    ratio,
    running_bridge,
    table,
)
from bench.report import environment

NAME = "console_talk"
COMMAND = "set the volume to thirty"
WAV_RATE = 48000
VOICE_RMS = 0.01  # the page's threshold (talk.js VOICE_RMS), on the same scale
FRAME_MS = 60
TURN_TIMEOUT_S = 120.0


@dataclass
class Turn:
    speech_end_to_first_frame_ms: float
    speech_end_to_first_audio_ms: float


async def run(quick: bool) -> str:
    quiet_logging()
    turns = 2 if quick else 8
    began = time.perf_counter()
    async with running_bridge(
        voice_enabled=True, llm_provider="none", search_enabled=False
    ) as bridge:
        key = await bridge.frontends.keys.create("bench talk", ["console:talk"])
        with tempfile.TemporaryDirectory(prefix="bench-talk-") as scratch:
            wav = _command_wav(Path(scratch) / "command.wav")
            browser_turns = await _browser_turns(bridge.api_url, key.token, wav, turns)
        python_turns = await _python_turns(bridge.ws_url, turns + 1)
    return _report(browser_turns, python_turns[1:], quick, time.perf_counter() - began)


# ---- the browser -------------------------------------------------------------------------------


def _command(rate: int) -> Any:
    """The command as eSpeak says it (as bench/voice.py speaks it), at `rate`."""
    import soxr

    from backend.voice.audio import Clip
    from backend.voice.tts import render

    clip = render(COMMAND, "en", 16000)
    if rate == 16000:
        return clip
    samples = np.frombuffer(clip.pcm, dtype=np.int16)
    return Clip(np.asarray(soxr.resample(samples, 16000, rate), dtype=np.int16).tobytes(), rate)


def _command_wav(path: Path) -> Path:
    from backend.voice.audio import Clip, wav_bytes

    clip = _command(WAV_RATE)
    second = bytes(2 * WAV_RATE)
    path.write_bytes(wav_bytes(Clip(second + clip.pcm + second * 5, WAV_RATE)))
    return path


COMMAND_TURNS = """(wanted) => window.talkStats.turns.filter(
  (turn) => (turn.transcript || "").toLowerCase().startsWith("set the volume")
    && turn.firstAudioAt !== null && turn.speechEndAt !== null
).length >= wanted"""


async def _browser_turns(origin: str, key: str, wav: Path, wanted: int) -> list[Turn]:
    args = [
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",
        "--autoplay-policy=no-user-gesture-required",
    ]
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=_chromium(), headless=True, args=args
        )
        try:
            context = await browser.new_context(permissions=["microphone"])
            await context.add_init_script(f"sessionStorage.setItem('bridge.key', {key!r});")
            page = await context.new_page()
            await page.goto(f"{origin}/talk")
            return await _talk(page, wanted)
        finally:
            await browser.close()


async def _talk(page: Page, wanted: int) -> list[Turn]:
    await page.get_by_role("button", name="Connect").click()
    await page.wait_for_function("() => window.talkStats.connected")
    await page.get_by_role("button", name="Hands-free").click()
    # One more than counted: the first answer is the first the page plays (a warm-up).
    await page.wait_for_function(
        COMMAND_TURNS, arg=wanted + 1, timeout=TURN_TIMEOUT_S * 1000 * (wanted + 1)
    )
    stats: dict[str, Any] = await page.evaluate("window.talkStats")
    if stats["uplinkFormat"] != "opus":
        raise SystemExit(f"the page fell back to {stats['uplinkFormat']}: no WebCodecs Opus")
    counted = [
        turn
        for turn in stats["turns"]
        if (turn["transcript"] or "").lower().startswith("set the volume")
    ][1 : wanted + 1]
    return [
        Turn(
            turn["firstFrameAt"] - turn["speechEndAt"],
            turn["firstAudioAt"] - turn["speechEndAt"],
        )
        for turn in counted
    ]


# ---- the Python stock device (baseline) --------------------------------------------------------


async def _python_turns(ws_url: str, count: int) -> list[Turn]:
    from simulator.voice_client import VoiceDevice, speech_frames

    clip = _command(16000)
    frames = speech_frames(clip, 900)
    voiced = [index for index, pcm in enumerate(frames) if _rms(pcm) > VOICE_RMS]
    last_voiced = voiced[-1]
    turns: list[Turn] = []
    async with VoiceDevice.websocket(ws_url, DEVICE_TOKEN, "02:00:00:00:7a:01", "bench") as device:
        await asyncio.sleep(0.5)  # MCP initialize and tools/list: the device is ready
        for _ in range(count):
            sent_at = len(device.frames)
            await device.listen_start("auto")
            loop = asyncio.get_running_loop()
            started = loop.time()
            offset = time.monotonic() - started
            await device.send_speech(clip, realtime=True, trailing_silence_ms=900)
            reply = await device.wait_turn(TURN_TIMEOUT_S)
            # Frame i left at started + i * 60 ms (send_speech's absolute schedule).
            speech_end = started + offset + last_voiced * FRAME_MS / 1000
            first = device.frames[sent_at][0]
            turns.append(Turn((first - speech_end) * 1000, (first - speech_end) * 1000))
            if not reply.frames:
                raise SystemExit("the Python device got no audio")
            await asyncio.sleep(0.3)
    return turns


def _rms(pcm: bytes) -> float:
    samples = np.frombuffer(pcm, dtype=np.int16).astype(np.float64) / 32768.0
    return float(np.sqrt(np.mean(samples * samples))) if samples.size else 0.0


# ---- report ------------------------------------------------------------------------------------


def _report(browser: list[Turn], python: list[Turn], quick: bool, elapsed: float) -> str:
    played = Stats.of([turn.speech_end_to_first_audio_ms for turn in browser])
    arrived = Stats.of([turn.speech_end_to_first_frame_ms for turn in browser])
    baseline = Stats.of([turn.speech_end_to_first_audio_ms for turn in python])

    def row(label: str, stats: Stats, values: list[float]) -> list[Any]:
        return [label, stats.count, f"{stats.p50:.0f}", f"{min(values):.0f}", f"{max(values):.0f}"]

    rows = [
        row("talk page in Chromium: speech end → first audio played", played,
            [t.speech_end_to_first_audio_ms for t in browser]),
        row("… of which speech end → first frame arrived", arrived,
            [t.speech_end_to_first_frame_ms for t in browser]),
        row("Python stock device (**baseline**): speech end → first frame arrived", baseline,
            [t.speech_end_to_first_audio_ms for t in python]),
    ]  # fmt: skip
    kind = "quick run (few turns)" if quick else "full run"
    return "\n".join(
        [
            "## Talk page: the browser as a voice device (`bench/console_talk.py`)",
            "",
            f"{environment()}; {kind}, {elapsed:.1f} s. One process: the bridge (embedded voice "
            "stack: Whisper tiny.en, offline chat, eSpeak NG) and headless Chromium, whose fake "
            f'microphone loops a WAV of "{COMMAND}" (1 s silence, the command, 5 s silence). '
            "The page talks hands-free (auto mode: the bridge's VAD ends the utterance after "
            "600 ms of silence, which every figure below includes). The page's first counted "
            "turn is its second (the first warms up WebCodecs and Web Audio); the baseline's "
            "first turn is dropped likewise. The browser turns run first, then the baseline "
            "turns, on the same bridge.",
            "",
            table(["measure", "turns", "p50 ms", "min ms", "max ms"], rows),
            "",
            f"Ratio talk page / baseline (p50): {ratio(played.p50, baseline.p50)}. What the "
            f"page clearly adds is {played.p50 - arrived.p50:.0f} ms (p50) from the first "
            "frame's arrival to its scheduled start: WebCodecs decoding and the page's 50 ms "
            "jitter lead. Up to the first frame's arrival the page differs from the baseline "
            f"by {arrived.p50 - baseline.p50:+.0f} ms at p50, within what this measure can "
            "resolve: speech end is found on each side's own signal, in 60 ms frames, and the "
            "page's signal went through Chromium's capture processing (echo cancellation, "
            "noise suppression, gain control) first; the capture path itself (128-sample "
            "AudioWorklet blocks, WebCodecs encoding, the browser's WebSocket) cannot be "
            "told apart from that at this resolution.",
        ]
    )


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise SystemExit("Chromium is not installed: run scripts/test, which installs it")
    return found


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
