"""`esp32-bridge demo` as a real process: it calls two tools, chats (offline: no model service on
a fresh machine), holds a spoken turn, then serves the CLI until SIGINT."""

import asyncio
import json
import os
import signal
from asyncio.subprocess import PIPE
from pathlib import Path

import numpy as np

from backend.voice.audio import read_wav
from tests.helpers import CLI, STARTED, eventually, run_cli, start_cli


async def test_demo_calls_tools_then_serves_cli_until_sigint(tmp_path):
    data_dir = tmp_path / "data"
    # A model URL where nothing listens (whatever runs on this machine's default port), and no
    # web search: a test never leaves loopback.
    env = {
        "COLUMNS": "200",
        "BRIDGE_LLM_BASE_URL": "http://127.0.0.1:9",
        "BRIDGE_SEARCH_ENABLED": "false",
    }
    process = await start_cli("demo", data_dir, env=env)
    try:
        output = b""
        async with asyncio.timeout(120):
            while b"Serving until Ctrl-C" not in output:
                line = await process.stdout.readline()
                assert line, f"demo exited early: {output.decode()}"
                output += line
        text = output.decode()
        assert "self.audio_speaker.set_volume" in text and "self.get_device_status" in text
        assert "device: volume = 42" in text
        assert text.count("→ HTTP 200") == 2
        status_json = text[text.index('{\n  "content"', text.index("self.get_device_status {}")) :]
        status = json.loads(status_json[: status_json.index("\n}\n") + 2])
        assert json.loads(status["content"][0]["text"])["audio_speaker"]["volume"] == 42

        # The scripted chat turn: a device command and a dental question in one sentence.
        chat = text[text.index("you> Set the volume to 30 and tell me how long I should brush") :]
        assert "no model service at http://127.0.0.1:9: offline mode" in text
        assert '  [tool] self.audio_speaker.set_volume {"volume":30}' in chat
        assert "device: volume = 30" in chat and "Volume set to 30." in chat
        answer = chat[chat.index("Volume set to 30.") :]
        assert "2 minutes" in answer and "\nSources:\n1. " in answer
        _assert_spoken_turn(text, data_dir)

        # From another terminal: the CLI finds the demo through the data directory.
        code, out, err = await run_cli("devices", "--data-dir", str(data_dir))
        assert code == 0 and "02:00:00:00:00:01" in out and "ready" in out, err
        code, out, err = await run_cli(
            "call",
            "02:00:00:00:00:01",
            "self.audio_speaker.set_volume",
            "--arg",
            "volume=70",
            "--data-dir",
            str(data_dir),
        )
        assert (code, out.strip()) == (0, "true"), err
    finally:
        process.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    assert "device: volume = 70" in rest.decode()
    assert "Traceback" not in err.decode()
    await eventually(lambda: not (data_dir / "bridge.json").exists())
    assert (data_dir / "bridge.sqlite3").exists()  # --data-dir: the demo's data is kept


async def test_demo_without_data_dir_uses_a_temporary_one_and_prints_commands_that_paste(
    tmp_path,
):
    """A fresh user's `./scripts/demo`: nothing lands in the default data directory (a later
    `serve` would inherit the demo's device and keys), and the printed commands run as printed,
    whole lines even at 80 columns in a pipe."""
    home = tmp_path / "home"
    temp = tmp_path / "tmp"
    home.mkdir()
    temp.mkdir()
    env = {
        **os.environ,
        "HOME": str(home),
        "TMPDIR": str(temp),
        "COLUMNS": "80",
        "BRIDGE_DATA_DIR": "",
        "BRIDGE_ADMIN_TOKEN": "",
        "BRIDGE_DEVICE_TOKEN": "",
        "BRIDGE_LLM_BASE_URL": "http://127.0.0.1:9",
        "BRIDGE_SEARCH_ENABLED": "false",
    }
    env.pop("BRIDGE_DATA_DIR")
    ports = ["--ws-port", "0", "--http-port", "0", "--device-http-port", "0"]
    process = await asyncio.create_subprocess_exec(
        *CLI, "demo", *ports, stdout=PIPE, stderr=PIPE, env=env
    )
    STARTED.append(process)
    try:
        lines: list[str] = []
        async with asyncio.timeout(120):
            while not lines or lines[-1] != "Serving until Ctrl-C. From another terminal try:":
                line = await process.stdout.readline()
                assert line, f"demo exited early: {''.join(lines)}"
                lines.append(line.decode().rstrip("\n"))
            hints = [(await process.stdout.readline()).decode().rstrip("\n") for _ in range(4)]
        (data_dir_line,) = [line for line in lines if line.startswith("data directory: ")]
        data_dir = Path(data_dir_line.split()[2])
        assert data_dir.parent == temp and data_dir.name.startswith("esp32-bridge-demo-")
        assert "temporary: removed when the demo stops" in data_dir_line
        assert (data_dir / "bridge.json").exists()
        assert not (home / ".local").exists()

        assert all(
            hint.startswith("  ") and hint.endswith(f"--data-dir {data_dir}") for hint in hints
        )
        devices, call = hints[0].strip(), hints[1].strip()
        assert (
            devices.split()[0] in ("esp32-bridge", ".venv/bin/esp32-bridge")
            or Path(devices.split()[0]).is_absolute()
        )
        assert call.split()[1:4] == ["call", "02:00:00:00:00:01", "self.audio_speaker.set_volume"]
        code, out, err = await _pasted(devices, env)
        assert code == 0 and "02:00:00:00:00:01" in out, err
        code, out, err = await _pasted(call, env)
        assert (code, out.strip()) == (0, "true"), err
    finally:
        process.send_signal(signal.SIGINT)
        _rest, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    await eventually(lambda: not data_dir.exists())
    assert not (home / ".local").exists()


async def _pasted(command: str, env: dict[str, str]) -> tuple[int | None, str, str]:
    """A printed command line run by a shell, as pasted into a terminal."""
    shell = await asyncio.create_subprocess_shell(command, stdout=PIPE, stderr=PIPE, env=env)
    out, err = await asyncio.wait_for(shell.communicate(), 60)
    return shell.returncode, out.decode(), err.decode()


def _assert_spoken_turn(text: str, data_dir: Path) -> None:
    """The demo's ending: a voice device says "set the volume to thirty"; it is recognized,
    acted on (the device's volume tool) and answered aloud, saved in the data dir."""
    spoken = text[text.index('says "set the volume to thirty" (synthesized offline)') :]
    assert "\ntranscript: set the volume to 30\n" in spoken.lower()
    assert '\ntool call: self.audio_speaker.set_volume {"volume":30}\n' in spoken
    assert "\nanswer: Volume set to 30.\n" in spoken
    wav = data_dir / "demo-answer.wav"
    assert f"saved to {wav}\n" in spoken
    clip = read_wav(wav)
    assert clip.duration_ms > 500
    assert np.abs(np.frombuffer(clip.pcm, dtype=np.int16).astype(np.int32)).max() > 1000
    lines = wav.with_suffix(".events.jsonl").read_text(encoding="utf-8").splitlines()
    events = [row["event"] for row in map(json.loads, lines) if "event" in row]
    assert {"type": "tts", "state": "stop"}.items() <= events[-1].items()
