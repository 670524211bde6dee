"""In-memory HAL for tests and the desktop simulator.

Same duck-typed interface as hal_esp32.HalEsp32. Every state change is appended to `changes` as
`(what, value)` and passed to the optional `on_change(what, value)` callback. Setters reject
values the MCP layer should never pass (ValueError), so a contract slip shows up in tests.
`changes` and `shown` keep the latest HISTORY entries: on the unix port main.py runs this HAL for
as long as the device runs, and an unbounded list ran a 175 KB heap out of memory.
"""

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
