"""What a talking device hears when recognition is the bottleneck: a long wait is announced
("One moment.") and the answer follows; a full queue is an apology alone, never silence and
never "One moment." followed by a refusal. The recognizer here is a stand-in whose queue and
wait the test sets; the bridge, the device and its audio are real (WebSocket on loopback)."""

import asyncio
import sys
from typing import Any

import pytest

from backend.server import Bridge
from backend.voice.recognition import RecognitionHints, RecognizerBusy, Transcript
from backend.voice.service import ONE_MOMENT, TOO_BUSY
from backend.voice.tts import render
from simulator.device_mcp import VOLUME_TOOL
from simulator.voice_client import VoiceDevice, speak_turn
from testkit.settings import DEVICE_TOKEN
from tests.helpers import eventually, wait_state

pytestmark = pytest.mark.slow


class QueueStandIn:
    """A recognizer with a backlog and a full queue the test chooses."""

    name = "stand-in"

    def __init__(self, backlog_s: float, full: bool) -> None:
        self.backlog, self.full = backlog_s, full
        self.release = asyncio.Event()
        self.heard = 0

    async def start(self) -> None:
        """Nothing to load."""

    def backlog_s(self) -> float:
        return self.backlog

    async def recognize(self, pcm: bytes, hints: RecognitionHints) -> Transcript:
        if self.full:  # refused at once, as DecodePool does, before any wait
            raise RecognizerBusy("8 utterances are waiting to be recognized")
        self.heard += 1
        await self.release.wait()
        return Transcript("set the volume to 30", self.name, "en", 0.95, sure=True)

    async def aclose(self) -> None:
        """Nothing to release."""


@pytest.fixture
async def voice_bridge(bridge_factory: Any) -> Bridge:
    bridge: Bridge = await bridge_factory(voice_enabled=True)
    await eventually(lambda: bridge.frontends.voice.pool.ready, timeout_s=30)
    return bridge


def _device(bridge: Bridge, device_id: str) -> VoiceDevice:
    return VoiceDevice.websocket(bridge.ws_url, DEVICE_TOKEN, device_id, f"client-{device_id}")


async def test_a_full_queue_is_an_apology_alone(voice_bridge: Bridge) -> None:
    voice_bridge.frontends.voice.recognizer = QueueStandIn(backlog_s=5.0, full=True)
    device_id = "02:00:00:00:c4:01"
    async with _device(voice_bridge, device_id) as device:
        await wait_state(voice_bridge, device_id)
        reply = await speak_turn(device, render("set the volume to thirty", "en", 16000))
    assert reply.sentences == [TOO_BUSY]
    assert device.mcp.calls == []


async def test_a_long_wait_is_announced_and_the_answer_follows(voice_bridge: Bridge) -> None:
    stand_in = QueueStandIn(backlog_s=5.0, full=False)
    voice_bridge.frontends.voice.recognizer = stand_in
    device_id = "02:00:00:00:c4:02"
    async with _device(voice_bridge, device_id) as device:
        await wait_state(voice_bridge, device_id)
        first = await speak_turn(device, render("set the volume to thirty", "en", 16000))
        assert first.sentences == [ONE_MOMENT] and stand_in.heard == 1
        stand_in.release.set()
        await device.wait_turn(timeout_s=30)
    assert device.mcp.calls[-1] == (VOLUME_TOOL, {"volume": 30})


async def test_a_short_wait_is_not_announced(voice_bridge: Bridge) -> None:
    stand_in = QueueStandIn(backlog_s=0.2, full=False)
    stand_in.release.set()
    voice_bridge.frontends.voice.recognizer = stand_in
    device_id = "02:00:00:00:c4:03"
    async with _device(voice_bridge, device_id) as device:
        await wait_state(voice_bridge, device_id)
        reply = await speak_turn(device, render("set the volume to thirty", "en", 16000))
    assert ONE_MOMENT not in reply.sentences
    assert device.mcp.calls[-1] == (VOLUME_TOOL, {"volume": 30})


_KILLED_BRIDGE = """
import asyncio, multiprocessing, sys
from backend.voice.recognition.pool import DecodePool, EngineSpec

async def main():
    pool = DecodePool(EngineSpec("builtins:dict"), workers=1, nice=0)
    pool.start()
    while not multiprocessing.active_children():
        await asyncio.sleep(0.001)
    if sys.argv[1] == "ready":
        await pool.wait_ready()
    print("PIDS", *[child.pid for child in multiprocessing.active_children()], flush=True)
    await asyncio.sleep(3600)

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("killed", ["ready", "starting"])
async def test_decoding_processes_leave_with_a_killed_bridge(tmp_path: Any, killed: str) -> None:
    """A bridge killed with SIGKILL cannot stop its decoding processes; they must not stay
    (300 MB each, and holding the bridge's stdout open, which hung a supervisor reading it),
    also when the bridge dies before they have started."""
    import psutil

    script = tmp_path / "bridge.py"
    script.write_text(_KILLED_BRIDGE)
    bridge = await asyncio.create_subprocess_exec(
        sys.executable, str(script), killed, stdout=asyncio.subprocess.PIPE
    )
    assert bridge.stdout is not None
    line = b""
    while not line.startswith(b"PIDS"):  # the pool's log lines come first
        line = await asyncio.wait_for(bridge.stdout.readline(), 60)
        assert line, "the bridge ended before its pool was ready"
    children = [psutil.Process(int(pid)) for pid in line.split()[1:]]
    assert children and all(child.is_running() for child in children)
    bridge.kill()
    await bridge.wait()
    # The pipe reaches its end only when no process holds it: the children left too.
    assert await asyncio.wait_for(bridge.stdout.read(), 20) == b""
    _, alive = psutil.wait_procs(children, timeout=10)
    assert alive == []
