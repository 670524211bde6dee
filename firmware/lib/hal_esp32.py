"""The real ESP32 hardware behind the duck-typed HAL (same interface as hal_fake.HalFake).

Device only: imports machine and network. Pins come from config.json "pins":
- "speaker_gain": optional PWM pin driving an amplifier gain input. Without it the volume is a
  software value kept for the audio path. The speaker always counts as present, like stock,
  which registers self.audio_speaker.set_volume on every board.
- "backlight": PWM pin of the screen backlight (brightness 0..100).
- "led": PWM pin of a status LED.
- "mic": I2S microphone {"sck", "ws", "sd", "bits"}: read at 16 kHz mono; "bits" 32 for
  INMP441-style microphones (24-bit samples in 32-bit slots: the top 16 bits are kept), 16 for
  microphones that deliver 16-bit samples.
- "speaker": I2S amplifier (MAX98357-style) {"sck", "ws", "sd"}: 16-bit mono at the rate the
  server hello announces, with the software volume applied (viper, audio.apply_volume) unless a
  "speaker_gain" pin sets the volume in hardware.
- "button": push-to-talk GPIO, active low with the internal pull-up.
There is no display driver yet, so the theme is not supported and show() prints to the console.
"""

import asyncio
import gc
import os

import machine
import network
from audio import FRAME_SAMPLES, SAMPLE_RATE, pcm32_to_pcm16
from protocol import wifi_signal

PWM_FREQ = 1000
REBOOT_DELAY_S = 1  # stock reboots ~1 s after answering, so the tool's reply still goes out
_WIFI_WAIT_STEPS = 100  # x 0.1 s per attempt
_WIFI_MAX_BACKOFF_S = 30
MIC_I2S_ID = 0
SPEAKER_I2S_ID = 1
I2S_IBUF = 8192  # bytes of DMA buffer per direction (~250 ms at 16 kHz)
BUTTON_POLL_MS = 20


def mac_address() -> str:
    """Wi-Fi STA MAC, lowercase and colon separated: the stock Device-Id."""
    wlan = network.WLAN(network.STA_IF)
    wlan.active(True)
    return _format_mac(wlan.config("mac"))


def _format_mac(raw) -> str:
    return ":".join("%02x" % byte for byte in raw)


async def connect_wifi(ssid, password, retries=5, log=print) -> bool:
    """Join the Wi-Fi network; retries with exponential backoff. True once connected."""
    wlan = network.WLAN(network.STA_IF)
    wlan.active(True)
    delay = 1
    for attempt in range(1, retries + 1):
        if wlan.isconnected():
            return True
        log("wifi: connecting to " + ssid + " (attempt %d of %d)" % (attempt, retries))
        try:
            wlan.connect(ssid, password)
        except OSError as error:
            log("wifi: connect failed: " + str(error))
        for _ in range(_WIFI_WAIT_STEPS):
            if wlan.isconnected():
                log("wifi: connected, IP " + wlan.ifconfig()[0])
                return True
            await asyncio.sleep(0.1)
        log("wifi: no connection (status %d); retrying in %d s" % (wlan.status(), delay))
        wlan.disconnect()
        await asyncio.sleep(delay)
        delay = min(delay * 2, _WIFI_MAX_BACKOFF_S)
    return wlan.isconnected()


def _pwm(pin, duty_u16=0):
    return machine.PWM(machine.Pin(pin), freq=PWM_FREQ, duty_u16=duty_u16)


def _percent_to_duty(percent) -> int:
    return percent * 65535 // 100


class HalEsp32:
    def __init__(self, pins, client_id, board_name="esp32-mcp-bridge", firmware_version="0.1.0"):
        self.board_name = board_name
        self.firmware_version = firmware_version
        self.client_id = client_id
        self.mac = mac_address()
        self.volume = 70
        self.brightness = 80
        self.led_on = False
        self.led_brightness = 100
        self._gain = _pwm(pins["speaker_gain"]) if pins.get("speaker_gain") is not None else None
        self._backlight = _pwm(pins["backlight"]) if pins.get("backlight") is not None else None
        self._led = _pwm(pins["led"]) if pins.get("led") is not None else None
        self._reboot_task = None
        self.microphone = I2sMicrophone(pins["mic"]) if pins.get("mic") else None
        self.speaker = I2sSpeaker(pins["speaker"]) if pins.get("speaker") else None
        self.button = GpioButton(pins["button"]) if pins.get("button") is not None else None
        self.set_volume(self.volume)
        self.set_brightness(self.brightness)

    def has(self, feature) -> bool:
        if feature == "speaker":
            return True
        if feature == "backlight":
            return self._backlight is not None
        if feature == "led":
            return self._led is not None
        return False  # "theme" needs a display driver

    # ---- speaker, screen, LED ---------------------------------------------------------------

    def get_volume(self) -> int:
        return self.volume

    def set_volume(self, v):
        self.volume = v
        if self._gain is not None:
            self._gain.duty_u16(_percent_to_duty(v))

    def software_volume(self) -> int:
        """The volume the audio path applies: all of it, unless an amplifier gain pin does."""
        return 100 if self._gain is not None else self.volume

    def get_brightness(self) -> int:
        return self.brightness

    def set_brightness(self, v):
        self.brightness = v
        if self._backlight is not None:
            self._backlight.duty_u16(_percent_to_duty(v))

    def get_theme(self) -> str:
        return "light"

    def set_theme(self, name) -> bool:
        return False

    def get_led(self) -> dict:
        return {"on": self.led_on, "brightness": self.led_brightness}

    def set_led(self, on, brightness):
        self.led_on = on
        self.led_brightness = brightness
        if self._led is not None:
            self._led.duty_u16(_percent_to_duty(brightness) if on else 0)

    # ---- status -----------------------------------------------------------------------------

    def network_status(self) -> dict:
        wlan = network.WLAN(network.STA_IF)
        if not wlan.isconnected():
            return {"type": "wifi", "ssid": "", "signal": "weak"}
        return {"type": "wifi", "ssid": wlan.config("ssid"), "signal": wifi_signal(_rssi(wlan))}

    def chip_temperature(self):
        """Chip temperature in °C, or None where the port cannot read it."""
        try:
            import esp32
        except ImportError:
            return None
        celsius = getattr(esp32, "mcu_temperature", None)  # S2/S3/C3
        if celsius is not None:
            return round(celsius(), 1)
        fahrenheit = getattr(esp32, "raw_temperature", None)  # classic ESP32
        if fahrenheit is not None:
            return round((fahrenheit() - 32) / 1.8, 1)
        return None

    def free_memory(self):
        return gc.mem_free()

    def system_info(self) -> dict:
        """The OTA-style system info of protocol reference §5.1, as far as MicroPython knows it."""
        wlan = network.WLAN(network.STA_IF)
        connected = wlan.isconnected()
        return {
            "version": 2,
            "language": "en-US",
            "flash_size": _flash_size(),
            "minimum_free_heap_size": str(_minimum_free_heap()),
            "mac_address": self.mac,
            "uuid": self.client_id,
            "chip_model_name": _chip_model(),
            "application": {"name": "esp32-mcp-bridge", "version": self.firmware_version},
            "board": {
                "type": self.board_name,
                "name": self.board_name,
                "ssid": wlan.config("ssid") if connected else "",
                "rssi": _rssi(wlan) if connected else 0,
                "channel": wlan.config("channel"),
                "ip": wlan.ifconfig()[0] if connected else "",
                "mac": self.mac,
            },
        }

    # ---- actions ----------------------------------------------------------------------------

    def reboot(self):
        """Reset after REBOOT_DELAY_S, so the reply to the reboot tool is sent first."""
        try:
            self._reboot_task = asyncio.create_task(_reset_later())
        except RuntimeError:  # no event loop running: nothing left to wait for
            machine.reset()

    def show(self, role, text):
        print("[" + role + "] " + text)


# ---- audio ------------------------------------------------------------------------------------


def _i2s(i2s_id, pins, mode, bits, rate):
    return machine.I2S(
        i2s_id,
        sck=machine.Pin(pins["sck"]),
        ws=machine.Pin(pins["ws"]),
        sd=machine.Pin(pins["sd"]),
        mode=mode,
        bits=bits,
        format=machine.I2S.MONO,
        rate=rate,
        ibuf=I2S_IBUF,
    )


async def _read_exactly(reader, buf):
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        got += await reader.readinto(view[got:])


class I2sMicrophone:
    """16 kHz mono capture into PCM16 frames; the I2S peripheral runs only while capturing."""

    def __init__(self, pins):
        self.pins = pins
        self.bits = int(pins.get("bits", 32))
        if self.bits not in (16, 32):
            raise ValueError("mic bits must be 16 or 32")
        self._raw = bytearray(FRAME_SAMPLES * 4) if self.bits == 32 else None
        self._i2s = None
        self._reader = None

    def start(self):
        if self._i2s is None:
            self._i2s = _i2s(MIC_I2S_ID, self.pins, machine.I2S.RX, self.bits, SAMPLE_RATE)
            self._reader = asyncio.StreamReader(self._i2s)

    def stop(self):
        i2s, self._i2s, self._reader = self._i2s, None, None
        if i2s is not None:
            i2s.deinit()

    async def read(self, buf) -> int:
        """One frame of PCM16 into buf (waits for the DMA to fill it)."""
        reader = self._reader
        if reader is None:
            raise OSError("microphone not started")
        if self._raw is None:
            await _read_exactly(reader, buf)
            return len(buf)
        raw = memoryview(self._raw)[: len(buf) * 2]
        await _read_exactly(reader, raw)
        return pcm32_to_pcm16(raw, buf) * 2


class I2sSpeaker:
    """16-bit mono playback at the downlink rate; write() returns once the DMA took the frame."""

    def __init__(self, pins):
        self.pins = pins
        self.sample_rate = None
        self._i2s = None
        self._writer = None

    def start(self, sample_rate):
        if self._i2s is not None and sample_rate == self.sample_rate:
            return
        self.stop()
        self.sample_rate = sample_rate
        self._i2s = _i2s(SPEAKER_I2S_ID, self.pins, machine.I2S.TX, 16, sample_rate)
        self._writer = asyncio.StreamWriter(self._i2s, {})

    def stop(self):
        i2s, self._i2s, self._writer = self._i2s, None, None
        if i2s is not None:
            i2s.deinit()

    async def write(self, buf):
        writer = self._writer
        if writer is None:
            raise OSError("speaker not started")
        writer.write(buf)
        await writer.drain()

    async def drain(self):
        """Wait while the DMA buffer plays out."""
        if self.sample_rate:
            await asyncio.sleep(I2S_IBUF / 2 / self.sample_rate)


class GpioButton:
    """Push-to-talk on a GPIO pulled up, pressed = low; polled with a debounce of one poll."""

    def __init__(self, pin):
        self._pin = machine.Pin(pin, machine.Pin.IN, machine.Pin.PULL_UP)
        self._pressed = False

    async def next_action(self):
        while True:
            await asyncio.sleep(BUTTON_POLL_MS / 1000)
            pressed = self._pin.value() == 0
            if pressed == self._pressed:
                continue
            await asyncio.sleep(BUTTON_POLL_MS / 1000)
            if (self._pin.value() == 0) == pressed:  # still so after the bounce
                self._pressed = pressed
                return "press" if pressed else "release"


async def _reset_later():
    await asyncio.sleep(REBOOT_DELAY_S)
    machine.reset()


def _rssi(wlan) -> int:
    return wlan.status("rssi")


def _flash_size() -> int:
    try:
        import esp

        return esp.flash_size()
    except (ImportError, AttributeError):
        return 0


def _minimum_free_heap() -> int:
    """Lowest free IDF data heap since boot where the port reports it, else free GC heap."""
    try:
        import esp32

        return sum(region[3] for region in esp32.idf_heap_info(esp32.HEAP_DATA))
    except (ImportError, AttributeError):
        return gc.mem_free()


def _chip_model() -> str:
    # os.uname().machine reads like "Generic ESP32S3 module with ESP32S3".
    machine_name = os.uname().machine
    cut = machine_name.rfind(" with ")
    return (machine_name[cut + 6 :] if cut >= 0 else machine_name).lower()
