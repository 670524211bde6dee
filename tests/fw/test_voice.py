import asyncio
import json
import struct

import audio
import hal_fake
import voice
from tinytest import TestCase

MIC_WAV = "test_voice_mic.wav"
FRAMES = 30  # in the microphone's file; frame n holds samples of value 100 * (n + 1)


def _frame(value, size=audio.FRAME_BYTES) -> bytes:
    return struct.pack("<h", value) * (size // 2)


def _write_mic_wav(frames, tail=b""):
    writer = audio.WavWriter(MIC_WAV, audio.SAMPLE_RATE)
    for n in range(frames):
        writer.write(_frame(100 * (n + 1)))
    writer.write(tail)
    writer.close()


class Link:
    """The app's side as voice.py sees it; records what would go to the bridge."""

    session_id = "s1"

    def __init__(self):
        self.texts = []
        self.frames = []

    async def voice_send(self, text):
        self.texts.append(json.loads(text))

    async def voice_audio(self, pcm):
        self.frames.append(pcm)


class GatedMicrophone(hal_fake.FakeMicrophone):
    """The file's frames, each read only once the test allows it (no reliance on scheduling)."""

    def __init__(self, path):
        super().__init__(path, speed=0)
        self.allowed = 0
        self._more = asyncio.Event()

    def allow(self, frames):
        self.allowed += frames
        self._more.set()

    async def read(self, buf):
        while self.allowed <= 0:
            self._more.clear()
            await self._more.wait()
        self.allowed -= 1
        return await super().read(buf)


class BlockedSpeaker(hal_fake.FakeSpeaker):
    """A speaker whose first write never returns (a stalled I2S DMA)."""

    async def write(self, buf):
        await asyncio.Event().wait()


async def spin(times=200):
    for _ in range(times):
        await asyncio.sleep(0)


async def until(condition, times=2000):
    for _ in range(times):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never met")


def _listen(state, mode=None):
    message = {"session_id": "s1", "type": "listen", "state": state}
    if mode is not None:
        message["mode"] = mode
    return message


class VoiceCase(TestCase):
    mode = "auto"

    def setUp(self):
        _write_mic_wav(FRAMES)
        self.hal = hal_fake.HalFake(audio={"speaker_wav": None})
        self.microphone = self.hal.microphone = GatedMicrophone(MIC_WAV)
        self.link = Link()
        self.voice = voice.Voice(self.hal, self.link, self.mode, log=lambda line: None)

    def tearDown(self):
        self.voice.close()
        import os

        os.remove(MIC_WAV)


class AutoModeTest(VoiceCase):
    async def test_listen_start_then_the_files_frames_in_order(self):
        self.voice.open()
        self.microphone.allow(5)
        await until(lambda: len(self.link.frames) == 5)
        self.assertEqual(self.link.texts, [_listen("start", "auto")])
        for n in range(5):
            self.assertEqual(self.link.frames[n], _frame(100 * (n + 1)))
        self.assertEqual(self.voice.state, voice.LISTENING)

    async def test_microphone_stops_while_speaking(self):
        self.voice.open()
        self.microphone.allow(3)
        await until(lambda: len(self.link.frames) == 3)
        self.voice.on_tts("start")
        self.microphone.allow(10)
        await spin()
        self.assertEqual(self.voice.state, voice.SPEAKING)
        self.assertEqual(len(self.link.frames), 3)

    async def test_tts_stop_drains_then_listens_again_further_in_the_file(self):
        self.hal.set_volume(50)
        self.voice.open()
        self.microphone.allow(2)
        await until(lambda: len(self.link.frames) == 2)
        self.voice.on_tts("start")
        before = len(self.link.frames)
        for value in (1000, -2000, 3000):
            self.assertTrue(self.voice.accept_audio(_frame(value)))
        self.voice.on_tts("stop")
        await until(lambda: len(self.link.texts) == 2)
        self.assertEqual(self.hal.speaker.data, _frame(500) + _frame(-1000) + _frame(1500))
        self.assertEqual(self.link.texts, [_listen("start", "auto")] * 2)
        self.assertEqual(self.voice.state, voice.LISTENING)
        self.microphone.allow(2)
        await until(lambda: len(self.link.frames) > before)
        # The file goes on (the frame being captured when speaking began is discarded).
        resumed = [_frame(100 * (n + 1)) for n in range(before, before + 2)]
        self.assertIn(self.link.frames[before], resumed)

    async def test_frames_outside_speaking_are_refused(self):
        self.voice.open()
        await until(lambda: self.voice.state == voice.LISTENING)
        self.assertFalse(self.voice.accept_audio(_frame(7)))
        self.voice.on_tts("start")
        self.voice.on_tts("stop")
        await until(lambda: self.voice.state == voice.LISTENING)
        self.assertFalse(self.voice.accept_audio(_frame(8)))
        self.assertEqual(self.voice.refused, 2)
        self.assertEqual(self.hal.speaker.data, bytearray())

    async def test_tts_stop_outside_speaking_changes_nothing(self):
        self.voice.open()
        await until(lambda: self.voice.state == voice.LISTENING)
        self.voice.on_tts("stop")
        self.voice.on_tts("sentence_end")
        await spin()
        self.assertEqual(self.voice.state, voice.LISTENING)
        self.assertEqual(self.link.texts, [_listen("start", "auto")])

    async def test_downlink_queue_holds_40_frames_and_counts_the_rest(self):
        self.hal.speaker = BlockedSpeaker()
        self.voice = voice.Voice(self.hal, self.link, "auto", log=lambda line: None)
        self.voice.open()
        await until(lambda: self.voice.state == voice.LISTENING)
        self.voice.on_tts("start")
        for n in range(45):
            self.assertTrue(self.voice.accept_audio(_frame(n)))
        self.assertEqual((len(self.voice.downlink), self.voice.downlink.dropped), (40, 5))
        await spin()  # the player takes one and stalls in write: room for exactly one more
        self.voice.accept_audio(_frame(99))
        self.voice.accept_audio(_frame(99))
        self.assertEqual((len(self.voice.downlink), self.voice.downlink.dropped), (40, 6))


class RealtimeModeTest(VoiceCase):
    mode = "realtime"

    async def test_microphone_keeps_streaming_while_speaking(self):
        self.voice.open()
        self.microphone.allow(2)
        await until(lambda: len(self.link.frames) == 2)
        self.voice.on_tts("start")
        self.microphone.allow(3)
        await until(lambda: len(self.link.frames) == 5)
        self.voice.on_tts("stop")
        await until(lambda: self.voice.state == voice.LISTENING)
        self.assertEqual(self.link.texts, [_listen("start", "realtime")])


class ManualModeTest(VoiceCase):
    mode = "manual"

    async def test_nothing_until_the_button_then_stop_on_release(self):
        self.voice.open()
        await spin()
        self.assertEqual((self.link.texts, self.link.frames), ([], []))
        await self.voice.on_button("press")
        self.microphone.allow(3)
        await until(lambda: len(self.link.frames) == 3)
        await self.voice.on_button("release")
        self.microphone.allow(3)
        await spin()
        self.assertEqual(len(self.link.frames), 3)
        self.assertEqual(self.link.texts, [_listen("start", "manual"), _listen("stop")])
        self.assertEqual(self.voice.state, voice.IDLE)

    async def test_tts_stop_goes_idle(self):
        self.voice.open()
        self.voice.on_tts("start")  # idle -> speaking is allowed after listen stop
        self.voice.accept_audio(_frame(4))
        self.voice.on_tts("stop")
        await until(lambda: self.voice.state == voice.IDLE)
        await spin()
        self.assertEqual(self.link.texts, [])
        self.assertEqual(self.hal.speaker.data, _frame(2))  # volume 70: 4 * 179 >> 8

    async def test_press_while_speaking_aborts_then_listens(self):
        self.voice.open()
        self.voice.on_tts("start")
        await self.voice.on_button("press")
        await self.voice.on_button("abort")
        abort = {"session_id": "s1", "type": "abort"}
        self.assertEqual(self.link.texts, [abort, _listen("start", "manual"), abort])
        self.assertFalse(self.voice.accept_audio(_frame(1)))


class ScriptedButtonTest(TestCase):
    async def test_actions_in_order_then_none(self):
        button = hal_fake.ScriptedButton([[0, "press"], [0, "release"]])
        actions = []
        for _ in range(3):
            actions.append(await button.next_action())
        self.assertEqual(actions, ["press", "release", None])


class FakeMicrophoneTest(TestCase):
    def tearDown(self):
        import os

        os.remove(MIC_WAV)

    async def test_pads_the_last_frame_then_gives_silence(self):
        _write_mic_wav(1, tail=struct.pack("<2h", 5, 6))
        microphone = hal_fake.FakeMicrophone(MIC_WAV, speed=0)
        microphone.start()
        buf = bytearray(audio.FRAME_BYTES)
        self.assertEqual(await microphone.read(buf), audio.FRAME_BYTES)
        self.assertEqual(bytes(buf), _frame(100))
        await microphone.read(buf)
        self.assertEqual(bytes(buf), struct.pack("<2h", 5, 6) + bytes(audio.FRAME_BYTES - 4))

    def test_refuses_a_file_at_another_rate(self):
        writer = audio.WavWriter(MIC_WAV, 8000)
        writer.close()
        with self.assertRaises(ValueError):
            hal_fake.FakeMicrophone(MIC_WAV).start()
