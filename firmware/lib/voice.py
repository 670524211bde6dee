"""The device's side of a voice turn, like the stock firmware (protocol reference §3).

States: idle, listening, speaking. `listen start` (mode auto, manual or realtime) enters
listening and the microphone's 60 ms PCM16 frames stream to the bridge; `tts start` enters
speaking: the microphone stops (except in realtime mode) and downlink frames are queued (at
most `queue_frames`; more are dropped and counted) and played with the software volume;
frames that arrive outside speaking are refused. `tts stop` lets the queue drain, then goes back
to listening (auto: with a fresh `listen start`; realtime: without) or to idle (manual).
The push-to-talk button presses (`listen start manual`, after an `abort` while speaking) and
releases (`listen stop`); an `abort` action sends `abort`.

The HAL brings the hardware (any of them may be None):
- `hal.microphone`: start(), stop(), `await read(buf)` -> bytes of PCM16 written into buf;
- `hal.speaker`: start(sample_rate), `await write(buf)` (returns once accepted), `await drain()`;
- `hal.button`: `await next_action()` -> "press", "release", "abort", or None when done;
- `hal.software_volume()`: the volume in percent applied to what is played.
The link (the app) brings `session_id`, `await voice_send(text)` and `await voice_audio(pcm)`.
Same code on the ESP32, the unix port and CPython.
"""

import asyncio

import protocol
from audio import FRAME_BYTES, QUEUE_FRAMES, SAMPLE_RATE, FrameQueue, apply_volume

IDLE = "idle"
LISTENING = "listening"
SPEAKING = "speaking"
MODES = ("auto", "manual", "realtime")


class Voice:
    def __init__(self, hal, link, mode="auto", queue_frames=QUEUE_FRAMES, log=print):
        if mode not in MODES:
            raise ValueError("voice mode must be auto, manual or realtime: " + repr(mode))
        self.hal = hal
        self.microphone = getattr(hal, "microphone", None)
        self.speaker = getattr(hal, "speaker", None)
        self.button = getattr(hal, "button", None)
        self.link = link
        self.mode = mode
        self.log = log
        self.state = IDLE
        self.downlink = FrameQueue(queue_frames)
        self.sample_rate = SAMPLE_RATE
        self.playable = True
        self.frames_sent = 0
        self.frames_played = 0
        self.refused = 0  # downlink frames that arrived outside speaking
        self._listen_mode = mode
        self._stop_pending = False
        self._capture = asyncio.Event()
        self._queued = asyncio.Event()
        self._tasks = []

    # ---- lifecycle ----------------------------------------------------------------------------

    def open(self, audio_format="pcm16", sample_rate=SAMPLE_RATE):
        """Start the audio tasks for a new session; auto and realtime modes start listening."""
        self.close()
        self.configure(audio_format, sample_rate)
        self._spawn(self._play_loop())
        if self.microphone is not None:
            self._spawn(self._capture_loop(self.microphone))
            if self.mode != "manual":
                self._spawn(self.start_listening())
        if self.button is not None:
            self._spawn(self._button_loop(self.button))

    def configure(self, audio_format, sample_rate):
        """The downlink format and rate the server hello announced."""
        self.sample_rate = sample_rate
        self.playable = audio_format == "pcm16"
        if not self.playable:
            self.log("voice: the server sends " + str(audio_format) + " audio; only pcm16 plays")

    def close(self):
        """End the session's audio: tasks cancelled, queue emptied, back to idle."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        self.downlink.clear()
        self._stop_pending = False
        self._set_state(IDLE)
        if self.microphone is not None:
            self.microphone.stop()

    def _spawn(self, coroutine):
        self._tasks.append(asyncio.create_task(coroutine))

    def _set_state(self, state):
        if state != self.state:
            self.log("voice: " + state)
        self.state = state
        capture = state == LISTENING or (state == SPEAKING and self._listen_mode == "realtime")
        if capture:
            self._capture.set()
        else:
            self._capture.clear()

    # ---- device actions -----------------------------------------------------------------------

    async def start_listening(self, mode=None) -> bool:
        """Send `listen start` and stream the microphone; False if it could not be sent."""
        mode = mode or self.mode
        if not await self._send(protocol.listen_start(self.link.session_id, mode)):
            return False
        self._listen_mode = mode
        self._stop_pending = False
        self.downlink.clear()
        self._set_state(LISTENING)
        return True

    async def stop_listening(self) -> bool:
        """Push-to-talk release: `listen stop`, then idle."""
        if self.state != LISTENING:
            return False
        self._set_state(IDLE)
        return await self._send(protocol.listen_stop(self.link.session_id))

    async def abort(self) -> bool:
        """Ask the bridge to stop talking (it answers with `tts stop`)."""
        return await self._send(protocol.abort(self.link.session_id))

    async def _send(self, text) -> bool:
        try:
            await self.link.voice_send(text)
        except (OSError, ValueError) as error:
            self.log("voice: not sent (" + str(error) + "): " + text[:60])
            return False
        return True

    # ---- from the bridge ----------------------------------------------------------------------

    def on_tts(self, state):
        """`tts start` enters speaking; `tts stop` leaves it once the queue has played."""
        if state == "start":
            if self.state != SPEAKING:
                self.downlink.clear()
                if self.speaker is not None:
                    self.speaker.start(self.sample_rate)
            self._stop_pending = False
            self._set_state(SPEAKING)
        elif state == "stop" and self.state == SPEAKING:
            self._stop_pending = True
            self._queued.set()

    def accept_audio(self, payload) -> bool:
        """Queue one downlink frame; False (refused) unless speaking. A full queue drops it."""
        if self.state != SPEAKING:
            self.refused += 1
            return False
        if self.playable and self.speaker is not None and self.downlink.push(payload):
            self._queued.set()
        return True

    # ---- tasks --------------------------------------------------------------------------------

    async def _play_loop(self):
        while True:
            frame = self.downlink.pop()
            if frame is not None:
                await self._play(frame)
            elif self._stop_pending:
                await self._finish_speaking()
            else:
                self._queued.clear()
                await self._queued.wait()

    async def _play(self, frame):
        speaker = self.speaker
        if speaker is None or self.state != SPEAKING:
            return
        buf = bytearray(frame)
        apply_volume(buf, self.hal.software_volume())
        await speaker.write(buf)
        self.frames_played += 1

    async def _finish_speaking(self):
        self._stop_pending = False
        if self.speaker is not None:
            await self.speaker.drain()
        if self.state != SPEAKING:
            return
        if self.mode == "manual" or self.microphone is None:
            self._set_state(IDLE)
        elif self._listen_mode == "realtime":
            self._set_state(LISTENING)  # still streaming: no new `listen start` (stock)
        elif not await self.start_listening(self._listen_mode):
            self._set_state(IDLE)

    async def _capture_loop(self, microphone):
        buf = bytearray(FRAME_BYTES)
        while True:
            await self._capture.wait()
            microphone.start()
            while self._capture.is_set():
                count = await microphone.read(buf)
                if count and self._capture.is_set():  # the turn may have moved on meanwhile
                    await self._send_frame(bytes(buf[:count]))
            microphone.stop()

    async def _send_frame(self, frame):
        try:
            await self.link.voice_audio(frame)
        except (OSError, ValueError) as error:
            self.log("voice: audio frame not sent: " + str(error))
            await asyncio.sleep(0.06)  # the link is going down; the app ends the session
            return
        self.frames_sent += 1

    async def _button_loop(self, button):
        while True:
            action = await button.next_action()
            if action is None:
                return
            await self.on_button(action)

    async def on_button(self, action):
        if action == "press":
            if self.state == SPEAKING:
                await self.abort()
            await self.start_listening("manual" if self.mode == "manual" else None)
        elif action == "release":
            if self.mode == "manual":
                await self.stop_listening()
        elif action == "abort":
            await self.abort()
        else:
            self.log("voice: unknown button action " + repr(action))
