"""The talk page in Chromium: the browser becomes a voice device and holds a spoken turn.

Chromium's fake microphone plays a WAV of "set the volume to thirty" (with silence around it,
looped); the page streams it in hands-free mode (listen start auto, the bridge's VAD ends the
utterance) through the browser device endpoint, the embedded voice stack recognizes it, the
offline chat sets the page's volume through the page's own MCP server, and the answer comes back
as audio that the page decodes and plays. The test reads the page's own figures
(`window.talkStats`): the transcript, the frames it received and the milliseconds it played.
"""

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import expect

from backend.mcp_session.errors import DeviceError
from backend.server import Bridge
from backend.voice.audio import Clip, wav_bytes
from tests.console_helpers import PHONE, assert_accessible, console_page, save_screenshot
from tests.helpers import create_key
from tests.voice_helpers import spoken

pytestmark = pytest.mark.slow

COMMAND = "set the volume to thirty"
WAV_RATE = 48000
TURN_TIMEOUT_MS = 60_000
# Every finished turn played all it received (a frame is 60 ms), and no turn is under way.
ALL_PLAYED = """() => {
  const stats = window.talkStats;
  return stats.state === "idle"
    && stats.turns.every((turn) => turn.audioPlayedMs >= (turn.framesReceived - 1) * 60);
}"""


def command_wav(path: Path, text: str = COMMAND) -> Path:
    """`text` spoken at 48 kHz with 1 s of silence before and 2.5 s after (the file loops)."""
    clip = spoken(text, WAV_RATE)
    silence = bytes(2 * WAV_RATE)  # one second of PCM16
    pcm = silence + clip.pcm + silence * 2 + silence[:WAV_RATE]
    path.write_bytes(wav_bytes(Clip(pcm, WAV_RATE)))
    return path


def fake_microphone(wav: Path) -> list[str]:
    return [
        "--use-fake-ui-for-media-stream",
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",
        "--autoplay-policy=no-user-gesture-required",
    ]


RECOGNIZED_TURN = """(command) => {
  const stats = window.talkStats;
  return stats.turns.find((turn) => (turn.transcript || "").toLowerCase().startsWith(command))
    || null;
}"""


# Real time: Chromium's fake microphone loops the WAV at its own pace, hands-free. Under the
# parallel phase's load recognition took 8 s, the loop's next pass talked over the answer and
# the turn was aborted (CI): it runs in the serial phase, like the voice loop's real-time tests.
@pytest.mark.serial
@pytest.mark.parametrize("codec", ["opus", "pcm16"])
async def test_the_browser_speaks_a_command_and_plays_the_answer(
    bridge_factory: Any, tmp_path: Path, codec: str
) -> None:
    """Opus through WebCodecs; "pcm16" hides `AudioEncoder` as a browser without it would."""
    bridge: Bridge = await bridge_factory(voice_enabled=True)
    token = await create_key(bridge, "console:talk")
    wav = command_wav(tmp_path / "command.wav")
    async with console_page(
        bridge, "/talk", token, browser_args=fake_microphone(wav), viewport=PHONE
    ) as console:
        page = console.page
        if codec == "pcm16":
            await page.evaluate("delete window.AudioEncoder")
        await page.get_by_role("button", name="Connect").click()
        status = page.locator("#talk-status")
        await expect(status).to_contain_text("Connected as browser-")
        assert bridge.registry.get(f"browser-{token.split('_')[1]}") is not None
        await page.get_by_role("button", name="Hands-free").click()
        turn = await (
            await page.wait_for_function(
                RECOGNIZED_TURN, arg="set the volume", timeout=TURN_TIMEOUT_MS
            )
        ).json_value()
        # Hands-free off; an answer under way plays to its end, and its last frames after it.
        await page.get_by_role("button", name="Hands-free: on").click()
        await page.wait_for_function(ALL_PLAYED, timeout=TURN_TIMEOUT_MS)
        stats = await page.evaluate("window.talkStats")
        assert stats["uplinkFormat"] == codec and stats["downlinkFormat"] == codec
        # The page received every frame the bridge sent and played each one once, 60 ms each.
        sent = [answer.stats.frames for answer in bridge.frontends.voice.answers]
        assert sum(t["framesReceived"] for t in stats["turns"]) == sum(sent), (stats, sent)
        for each in stats["turns"]:
            assert abs(each["audioPlayedMs"] - each["framesReceived"] * 60) <= 60, each
        played = next(t for t in stats["turns"] if t["transcript"] == turn["transcript"])
        assert played["audioPlayedMs"] > 500, played
        assert played["speechEndAt"] is not None
        assert played["firstAudioAt"] > played["speechEndAt"]
        # The bridge acted on it through the page's own MCP server: the page's speaker is at 30.
        assert stats["volume"] == 30
        await expect(page.locator("#talk-volume")).to_have_value("30")
        # The transcript is on the page: the user's words and the assistant's sentences.
        log = page.locator("#talk-transcript")
        await expect(log.locator(".talk-user", has_text="set the volume").first).to_be_visible()
        await expect(log.locator(".talk-assistant").first).not_to_be_empty()
        assert stats["sentences"], stats
        await assert_accessible(page)
        if codec == "opus":  # the recognized turn and its answer in view
            await log.locator(
                ".talk-user", has_text="set the volume"
            ).first.scroll_into_view_if_needed()
            await save_screenshot(page, "talk")
        await page.get_by_role("button", name="Disconnect").click()
        await expect(status).to_contain_text("Disconnected")
        console.assert_clean()


async def test_without_a_talk_scope_the_page_says_so(bridge: Bridge) -> None:
    token = await create_key(bridge, "chat:use")
    async with console_page(bridge, "/talk", token) as console:
        await expect(console.page.get_by_role("status")).to_contain_text("console:talk")
        await assert_accessible(console.page)
        console.assert_clean()


async def test_a_transcript_longer_than_the_screen_scrolls_from_the_keyboard(
    bridge: Bridge,
) -> None:
    token = await create_key(bridge, "console:talk")
    async with console_page(bridge, "/talk", token, viewport=PHONE) as console:
        page = console.page
        lines = 40  # many turns: the list scrolls inside its card
        await page.evaluate(
            """count => {
                const log = document.querySelector(".talk-log");
                for (let i = 0; i < count; i++) {
                    const li = document.createElement("li");
                    li.className = "talk-user";
                    li.textContent = `set the volume to ${i}`;
                    log.append(li);
                }
            }""",
            lines,
        )
        log = page.locator(".talk-log")
        assert await log.evaluate("ol => ol.scrollHeight > ol.clientHeight")
        await log.focus()
        await page.keyboard.press("End")
        assert await log.evaluate("ol => ol.scrollTop > 0")
        await assert_accessible(page)
        console.assert_clean()


async def test_without_a_microphone_the_page_says_so_and_still_connects(bridge: Bridge) -> None:
    """Chromium without a capture device: getUserMedia fails; the page says why."""
    token = await create_key(bridge, "console:talk")
    async with console_page(bridge, "/talk", token) as console:
        page = console.page
        await page.get_by_role("button", name="Connect").click()
        await expect(page.locator("#talk-status")).to_contain_text("Connected as browser-")
        await page.get_by_role("button", name="Hands-free").click()
        await expect(page.locator("#talk-status")).to_contain_text("microphone")
        # The device still answers its tools, from the page.
        device_id = f"browser-{token.split('_')[1]}"
        device = bridge.registry.require(device_id)
        result = await device.call_tool("self.audio_speaker.set_volume", {"volume": 55})
        assert not result.is_error
        await expect(page.locator("#talk-volume")).to_have_value("55")
        status = await device.call_tool("self.get_device_status", {})
        assert json.loads(status.content[0]["text"])["audio_speaker"] == {"volume": 55}
        # The page's MCP server answers what it does not serve with a JSON-RPC error.
        with pytest.raises(DeviceError) as unknown:
            await device.mcp.request("resources/list")
        assert unknown.value.code == -32601
        with pytest.raises(DeviceError) as no_tool:
            await device.mcp.request("tools/call", {"name": "self.reboot", "arguments": {}})
        assert "Unknown tool" in str(no_tool.value)
        console.assert_clean()


async def test_hold_to_talk_with_the_space_key_and_stop_the_answer(
    bridge_factory: Any, tmp_path: Path
) -> None:
    """Space held: listen start manual and audio; released: listen stop, the bridge answers;
    "Stop answer" sends abort and silences the page at once."""
    bridge: Bridge = await bridge_factory(voice_enabled=True)
    token = await create_key(bridge, "console:talk")
    wav = command_wav(tmp_path / "command.wav")
    async with console_page(bridge, "/talk", token, browser_args=fake_microphone(wav)) as console:
        page = console.page
        await page.get_by_role("button", name="Connect").click()
        await expect(page.locator("#talk-status")).to_contain_text("Connected as browser-")
        await page.locator("#talk-hold").focus()
        await page.keyboard.down("Space")
        await expect(page.locator("#talk-status")).to_have_text("Listening…")
        await page.wait_for_function("() => window.talkStats.framesSent >= 100")  # 6 s
        await page.keyboard.up("Space")
        await page.wait_for_function(
            "() => window.talkStats.state === 'speaking'", timeout=TURN_TIMEOUT_MS
        )
        stats = await page.evaluate("window.talkStats")
        assert len(stats["transcripts"]) == 1, stats
        await page.wait_for_function("() => window.talkStats.framesReceived >= 3")
        await page.get_by_role("button", name="Stop answer").click()
        await expect(page.locator("#talk-status")).to_have_text("Connected. Hold to talk.")
        received = (await page.evaluate("window.talkStats"))["framesReceived"]
        # The answer stops at the bridge too: its frame count stays put.
        answer = bridge.frontends.voice.answers[-1]
        sent = answer.stats.frames
        await asyncio.sleep(0.5)
        assert answer.stats.frames <= sent + 1
        after = await page.evaluate("window.talkStats")
        assert after["framesReceived"] <= received + 2, (received, after)
        assert after["state"] == "idle"
        console.assert_clean()
