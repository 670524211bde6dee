"""`esp32-bridge simulate --say/--speak` as a real subprocess against a real bridge with voice:
one stock-style voice device speaks, the bridge recognizes it, acts on it and answers aloud; the
command prints the turn and saves what the device heard (WAV) with its events (JSON lines)."""

import asyncio
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from backend.cli.voice import TurnOptions, waiting
from backend.voice.audio import Clip, read_wav, write_wav
from backend.voice.tts import render
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from tests.helpers import run_cli

VOICE_DEVICE = "02:00:00:00:03:e8"  # the voice device's default id (index 1000)
# The CLI finds the bridge through its data dir; no token from the test environment.
NO_TOKENS = {"BRIDGE_ADMIN_TOKEN": "", "BRIDGE_DEVICE_TOKEN": ""}


def _events(wav: Path) -> list[dict[str, Any]]:
    lines = wav.with_suffix(".events.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _messages(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row["event"] for row in rows if "event" in row]


def _assert_heard_speech(wav: Path, sample_rate: int) -> Clip:
    clip = read_wav(wav)
    samples = np.frombuffer(clip.pcm, dtype=np.int16).astype(np.int32)
    assert clip.sample_rate == sample_rate
    assert clip.duration_ms > 500
    assert np.abs(samples).max() > 1000  # speech, not silence
    return clip


def _assert_one_line_error(code: int, out: str, err: str, message: str) -> None:
    """One `error:` line on stderr (after the one `waiting for` line of a turn that started)."""
    assert code != 0, out
    assert message in err
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    if lines and lines[0].startswith("waiting for the spoken answer: "):
        lines = lines[1:]
    assert len(lines) == 1, err


@pytest.mark.slow
async def test_say_enrols_speaks_and_saves_what_the_device_heard(bridge_factory, tmp_path):
    bridge = await bridge_factory(voice_enabled=True, device_auth="device")
    wav = tmp_path / "out" / "answer.wav"
    code, out, err = await run_cli(
        "simulate", "--say", "set the volume to thirty", "--save", str(wav),
        "--data-dir", str(bridge.settings.data_dir),
        env={**NO_TOKENS, "BRIDGE_ADMIN_TOKEN": ADMIN_TOKEN},
    )  # fmt: skip
    assert code == 0, err
    # Not a terminal: one line says what it waits for, on stderr (stdout has the turn only).
    assert err.startswith("waiting for the spoken answer: ") and len(err.splitlines()) == 1, err
    assert "waiting" not in out
    assert "transcript: set the volume to 30" in out.lower()  # Whisper writes a capital
    assert 'tool call: self.audio_speaker.set_volume {"volume":30}' in out
    assert "answer: Volume set to 30." in out
    assert f"saved to {wav}" in out and f"events: {wav.with_suffix('.events.jsonl')}" in out
    # It enrolled through the OTA endpoint with an enrollment code made for it.
    provisioned = bridge.provisioning.store.device(VOICE_DEVICE)
    assert provisioned is not None and provisioned.approved_by.startswith("auto:enrollment:")
    _assert_heard_speech(wav, 24000)  # the bridge's default Opus downlink rate
    messages = _messages(_events(wav))
    assert messages[0]["type"] == "hello" and messages[0]["audio_params"]["format"] == "opus"
    assert {"type": "tts", "state": "stop"}.items() <= messages[-1].items()
    assert any(m["type"] == "stt" and m["text"].lower() == "set the volume to 30" for m in messages)


@pytest.mark.slow
async def test_speak_a_wav_file_in_pcm16_manual_mode_protocol_3(bridge_factory, tmp_path):
    bridge = await bridge_factory(voice_enabled=True)
    question = tmp_path / "question.wav"
    write_wav(question, render("how often should i floss", "en", 22050))  # resampled to 16 kHz
    wav = tmp_path / "answer.wav"
    code, out, err = await run_cli(
        "simulate", "--speak", str(question), "--codec", "pcm16", "--mode", "manual",
        "--protocol-version", "3", "--url", bridge.ws_url, "--token", DEVICE_TOKEN,
        "--save", str(wav), "--data-dir", str(tmp_path / "cli"), env=NO_TOKENS,
    )  # fmt: skip
    assert code == 0, err
    assert "(pcm16, manual mode)" in out
    transcript = next(line for line in out.splitlines() if line.startswith("transcript: "))
    assert transcript != "transcript: (nothing recognized)"
    assert "answer: " in out and "answer: (no sentence)" not in out
    _assert_heard_speech(wav, 16000)  # a PCM16 device gets PCM16 at 16 kHz
    rows = _events(wav)
    assert {row["frame_bytes"] for row in rows if "frame_bytes" in row} == {1920}  # 60 ms
    messages = _messages(rows)
    assert messages[0]["audio_params"]["format"] == "pcm16"
    assert {"type": "tts", "state": "stop"}.items() <= messages[-1].items()


@pytest.mark.slow
async def test_say_over_mqtt_and_udp(bridge_factory, tmp_path):
    bridge = await bridge_factory(
        voice_enabled=True,
        device_auth="device",
        mqtt_url="embedded",
        mqtt_host="127.0.0.1",
        mqtt_port=0,
        udp_host="127.0.0.1",
        udp_port=0,
    )
    wav = tmp_path / "answer.wav"
    code, out, err = await run_cli(
        "simulate", "--transport", "mqtt", "--say", "set the volume to seventy",
        "--save", str(wav), "--data-dir", str(bridge.settings.data_dir),
        env={**NO_TOKENS, "BRIDGE_ADMIN_TOKEN": ADMIN_TOKEN},
    )  # fmt: skip
    assert code == 0, err
    assert 'tool call: self.audio_speaker.set_volume {"volume":70}' in out
    _assert_heard_speech(wav, 24000)
    hello = next(m for m in _messages(_events(wav)) if m["type"] == "hello")
    assert hello["transport"] == "udp" and "udp" in hello  # the answer came over UDP
    # It logged in to the broker with the login its OTA answer gave it.
    provisioned = bridge.provisioning.store.device(VOICE_DEVICE)
    assert provisioned is not None and provisioned.transport == "mqtt"


async def test_a_bridge_without_voice_is_a_one_line_error(bridge_factory, tmp_path):
    bridge = await bridge_factory(voice_enabled=False)
    wav = tmp_path / "answer.wav"
    code, out, err = await run_cli(
        "simulate", "--say", "set the volume to thirty", "--url", bridge.ws_url,
        "--token", DEVICE_TOKEN, "--save", str(wav), "--data-dir", str(tmp_path), env=NO_TOKENS,
    )  # fmt: skip
    _assert_one_line_error(
        code,
        out,
        err,
        "the bridge cannot answer by voice: "
        "voice is turned off on this bridge (voice_enabled = false)",
    )
    assert not wav.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--say", "hello", "--speak", "x.wav"], "--say and --speak exclude each other"),
        (["--say", "hello", "--devices", "2"], "--say/--speak simulate one voice device"),
        (["--say", "hello", "--codec", "mp3"], "--codec must be opus or pcm16, got 'mp3'"),
        (["--say", "hello", "--mode", "realtime"], "--mode must be auto or manual"),
        (["--speak", "{missing}"], "cannot read"),
    ],
)
async def test_bad_voice_options_are_one_line_errors(tmp_path, args, message):
    args = [arg.replace("{missing}", str(tmp_path / "missing.wav")) for arg in args]
    code, out, err = await run_cli("simulate", *args, "--data-dir", str(tmp_path), env=NO_TOKENS)
    _assert_one_line_error(code, out, err, message)


async def test_a_turn_says_what_it_waits_for_on_stderr():
    """On a terminal a spinner shows the stage and the seconds spent; elsewhere one line."""
    clip = SimpleNamespace(duration_ms=2300)
    terminal = Console(file=io.StringIO(), force_terminal=True, width=80)
    async with waiting(terminal, clip, TurnOptions()) as progress:
        progress("speaking (2.3 s of speech)")
        await asyncio.sleep(0.7)
        progress("waiting for the spoken answer (up to 30 s)")
    shown = terminal.file.getvalue()
    assert re.search(r"speaking \(2\.3 s of speech\) \([0-9]+ s\)", shown)
    assert re.search(r"waiting for the spoken answer \(up to 30 s\) \([1-9][0-9]* s\)", shown)

    log = Console(file=io.StringIO(), force_terminal=False, width=80)
    async with waiting(log, clip, TurnOptions()) as progress:
        progress("speaking (2.3 s of speech)")
    assert log.file.getvalue() == (
        "waiting for the spoken answer: 2.3 s of speech, then up to 30 s for the answer\n"
    )
