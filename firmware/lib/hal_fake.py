"""In-memory HAL for tests and the desktop simulator.

Same duck-typed interface as hal_esp32.HalEsp32. Every state change is appended to `changes` as
`(what, value)` and passed to the optional `on_change(what, value)` callback. Setters reject
values the MCP layer should never pass (ValueError), so a contract slip shows up in tests.
`changes` and `shown` keep the latest HISTORY entries: on the unix port main.py runs this HAL for
as long as the device runs, and an unbounded list ran a 175 KB heap out of memory.

Audio (config "audio", all optional): `mic_wav` is a 16 kHz PCM16 mono WAV file the microphone
reads (60 ms frames at `mic_speed` x real time, 0 = as fast as the app reads; silence after its
end, in real time); `speaker_wav` is the WAV file the speaker writes what it plays, after the
volume (`speaker_speed` paces it likewise; default 0); `events` is a JSON lines file that gets
every text shown (stt, llm, tts sentences); `button` is a script of [seconds, action] pairs,
action "press", "release" or "abort", timed from the first voice session.
"""

import asyncio
import json

from audio import SAMPLE_RATE, WavReader, WavWriter
from compat import ticks_diff, ticks_ms
from protocol import wifi_signal

ALL_FEATURES = ("speaker", "backlight", "theme", "led")
THEMES = ("light", "dark")
ROLES = ("user", "assistant", "alert", "system")
HISTORY = 64


def _keep(items, item):
    if len(items) >= HISTORY:
        del items[0]
    items.append(item)


def _check_percent(what, value):
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        raise ValueError(what + " must be an int in 0..100, got " + repr(value))


class HalFake:
    def __init__(
        self,
        features=ALL_FEATURES,
        board_name="hal-fake",
        firmware_version="0.1.0",
        on_change=None,
        mac="02:00:00:00:00:01",
        client_id="00000000-0000-4000-8000-000000000001",
        ssid="sim-net",
        rssi=-52,
        chip_temperature=41.5,
        free_memory=None,
        audio=None,
    ):
        self.board_name = board_name
        self.firmware_version = firmware_version
        self.features = tuple(features)
        self.on_change = on_change
        self.mac = mac
        self.client_id = client_id
        self.ssid = ssid
        self.rssi = rssi
        self.temperature = chip_temperature
        self.free_bytes = free_memory
        self.changes = []
        self.volume = 70
        self.brightness = 80
        self.theme = "light"
        self.led_on = False
        self.led_brightness = 100
        self.reboots = 0
        self.shown = []
        self.microphone = self.speaker = self.button = self._events = None
        if audio:
            self._attach_audio(audio)

    def _attach_audio(self, audio):
        if audio.get("mic_wav"):
            self.microphone = FakeMicrophone(audio["mic_wav"], float(audio.get("mic_speed", 1)))
        if "speaker_wav" in audio:  # null: played audio kept in memory
            self.speaker = FakeSpeaker(audio["speaker_wav"], float(audio.get("speaker_speed", 0)))
        if audio.get("button"):
            self.button = ScriptedButton(audio["button"])
        self._events = audio.get("events")

    def software_volume(self) -> int:
        """The volume the audio path applies to what it plays (percent)."""
        return self.volume

    def has(self, feature) -> bool:
        return feature in self.features

    def _record(self, what, value):
        _keep(self.changes, (what, value))
        if self.on_change is not None:
            self.on_change(what, value)

    def get_volume(self) -> int:
        return self.volume

    def set_volume(self, v):
        _check_percent("volume", v)
        self.volume = v
        self._record("volume", v)

    def get_brightness(self) -> int:
        return self.brightness

    def set_brightness(self, v):
        _check_percent("brightness", v)
        self.brightness = v
        self._record("brightness", v)

    def get_theme(self) -> str:
        return self.theme

    def set_theme(self, name) -> bool:
        if name not in THEMES:
            return False
        self.theme = name
        self._record("theme", name)
        return True

    def get_led(self) -> dict:
        return {"on": self.led_on, "brightness": self.led_brightness}

    def set_led(self, on, brightness):
        if on is not True and on is not False:
            raise ValueError("led on must be a bool, got " + repr(on))
        _check_percent("led brightness", brightness)
        self.led_on = on
        self.led_brightness = brightness
        self._record("led", self.get_led())

    def network_status(self) -> dict:
        return {"type": "wifi", "ssid": self.ssid, "signal": wifi_signal(self.rssi)}

    def chip_temperature(self):
        return self.temperature

    def free_memory(self):
        return self.free_bytes

    def system_info(self) -> dict:
        """The OTA-style system info of protocol reference §5.1, with host values."""
        return {
            "version": 2,
            "language": "en-US",
            "flash_size": 4194304,
            "minimum_free_heap_size": str(self.free_bytes or 0),
            "mac_address": self.mac,
            "uuid": self.client_id,
            "chip_model_name": "host",
            "application": {"name": "esp32-mcp-bridge", "version": self.firmware_version},
            "board": {
                "type": self.board_name,
                "name": self.board_name,
                "ssid": self.ssid,
                "rssi": self.rssi,
                "mac": self.mac,
            },
        }

    def reboot(self):
        self.reboots += 1
        self._record("reboot", self.reboots)

    def show(self, role, text):
        if role not in ROLES:
            raise ValueError("unknown display role: " + repr(role))
        _keep(self.shown, (role, text))
        self._record("show", (role, text))
        if self._events:
            with open(self._events, "a") as events:
                events.write(json.dumps({"role": role, "text": text}) + "\n")


def _duration_ms(size, sample_rate):
    return size * 500 / sample_rate  # PCM16 mono: 2 bytes a sample


def _pad(buf, start):
    for i in range(start, len(buf)):
        buf[i] = 0


class _Pacer:
    """Sleeps so successive steps happen `interval_ms` apart (0: just yields)."""

    def __init__(self):
        self._start = ticks_ms()
        self._due_ms = 0

    def restart(self):
        self._start = ticks_ms()
        self._due_ms = 0

    async def step(self, interval_ms):
        if interval_ms <= 0:
            await asyncio.sleep(0)
            return
        self._due_ms += interval_ms
        ahead_ms = self._due_ms - ticks_diff(ticks_ms(), self._start)
        await asyncio.sleep(max(0, ahead_ms) / 1000)


class FakeMicrophone:
    """A WAV file as the microphone; read() returns one frame of PCM16 per call."""

    def __init__(self, path, speed=1.0):
        self.path = path
        self.speed = speed
        self.frames = 0  # frames delivered
        self.capturing = False
        self._wav = None
        self._ended = False
        self._pacer = _Pacer()

    def start(self):
        if self.capturing:
            return
        self.capturing = True
        if self._wav is None and not self._ended:
            self._wav = WavReader(self.path)
            if self._wav.sample_rate != SAMPLE_RATE:
                self._wav.close()
                raise ValueError("mic_wav must be 16000 Hz, not %d" % self._wav.sample_rate)
        self._pacer.restart()

    def stop(self):
        self.capturing = False

    async def read(self, buf) -> int:
        count = self._wav.readinto(buf) if self._wav is not None else 0
        if count < len(buf):
            _pad(buf, count)
            if self._wav is not None:
                self._wav.close()
                self._wav, self._ended = None, True
        speed = self.speed if count else 1  # silence after the file: real time, never a flood
        await self._pacer.step(_duration_ms(len(buf), SAMPLE_RATE) / speed if speed > 0 else 0)
        self.frames += 1
        return len(buf)


class FakeSpeaker:
    """Writes what it plays to a WAV file (or keeps it in `data` when path is None)."""

    def __init__(self, path=None, speed=0.0):
        self.path = path
        self.speed = speed
        self.frames = 0
        self.sample_rate = None
        self.data = bytearray() if path is None else None
        self._wav = None
        self._pacer = _Pacer()

    def start(self, sample_rate):
        if self.sample_rate is None:
            self.sample_rate = sample_rate
            if self.path is not None:
                self._wav = WavWriter(self.path, sample_rate)
        self._pacer.restart()

    async def write(self, buf):
        if self._wav is not None:
            self._wav.write(buf)
        elif self.data is not None:
            self.data += buf
        self.frames += 1
        duration = _duration_ms(len(buf), self.sample_rate or SAMPLE_RATE)
        await self._pacer.step(duration / self.speed if self.speed > 0 else 0)

    async def drain(self):
        if self._wav is not None:
            self._wav.flush()

    def close(self):
        if self._wav is not None:
            self._wav.close()
            self._wav = None


class ScriptedButton:
    """Push-to-talk from a script: [[seconds, "press"|"release"|"abort"], ...]."""

    def __init__(self, script):
        self.script = [(float(at), action) for at, action in script]
        self._next = 0
        self._start = None

    async def next_action(self):
        if self._start is None:
            self._start = ticks_ms()
        if self._next >= len(self.script):
            return None
        at, action = self.script[self._next]
        self._next += 1
        await asyncio.sleep(max(0, at * 1000 - ticks_diff(ticks_ms(), self._start)) / 1000)
        return action
