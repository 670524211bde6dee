"""`esp32-bridge demo` as a real process: it calls two tools, chats (offline: no model service on
a fresh machine), then serves the CLI until SIGINT."""

import asyncio
import json
import signal

from tests.helpers import eventually, run_cli, start_cli


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
        async with asyncio.timeout(60):
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
