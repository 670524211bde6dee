import json

import tools_stock
from fw_support import (
    MODEL_TOOLS,
    USER_TOOLS,
    all_tool_names,
    call_tool,
    error_of,
    list_page,
    tool_text,
)
from hal_fake import HalFake
from mcp_server import INVALID_PARAMS, McpServer
from tinytest import TestCase

TOOL_OF_FEATURE = {
    "speaker": "self.audio_speaker.set_volume",
    "backlight": "self.screen.set_brightness",
    "theme": "self.screen.set_theme",
    "led": "self.led.set",
}


def _registered(hal):
    server = McpServer(hal.board_name, hal.firmware_version)
    tools_stock.register(server, hal)
    return server


def _schema_of(server, name):
    for tool in list_page(server, with_user_tools=True)["tools"]:
        if tool["name"] == name:
            return tool["inputSchema"]
    raise AssertionError(name + " not listed")


class RegistrationTest(TestCase):
    def test_full_hal_in_stock_order(self):
        server = _registered(HalFake())
        self.assertEqual(all_tool_names(server), MODEL_TOOLS)
        self.assertEqual(all_tool_names(server, True), MODEL_TOOLS + USER_TOOLS)

    def test_user_tools_are_annotated(self):
        tools = list_page(_registered(HalFake()), with_user_tools=True)["tools"]
        annotated = [tool["name"] for tool in tools if "annotations" in tool]
        self.assertEqual(annotated, USER_TOOLS)

    def test_bare_hal_has_only_the_unconditional_tools(self):
        server = _registered(HalFake(features=()))
        self.assertEqual(all_tool_names(server, True), ["self.get_device_status"] + USER_TOOLS)

    def test_each_feature_adds_exactly_its_tool(self):
        for feature, tool in TOOL_OF_FEATURE.items():
            server = _registered(HalFake(features=[feature]))
            self.assertEqual(all_tool_names(server), ["self.get_device_status", tool], feature)

    def test_stock_schemas(self):
        server = _registered(HalFake())
        volume = {"type": "integer", "minimum": 0, "maximum": 100}
        self.assertEqual(
            _schema_of(server, "self.audio_speaker.set_volume"),
            {"type": "object", "properties": {"volume": volume}, "required": ["volume"]},
        )
        self.assertEqual(
            _schema_of(server, "self.screen.set_brightness"),
            {"type": "object", "properties": {"brightness": volume}, "required": ["brightness"]},
        )
        self.assertEqual(
            _schema_of(server, "self.screen.set_theme"),
            {"type": "object", "properties": {"theme": {"type": "string"}}, "required": ["theme"]},
        )
        led_brightness = {"type": "integer", "default": 100, "minimum": 0, "maximum": 100}
        self.assertEqual(
            _schema_of(server, "self.led.set"),
            {
                "type": "object",
                "properties": {"on": {"type": "boolean"}, "brightness": led_brightness},
                "required": ["on"],
            },
        )
        for name in ["self.get_device_status"] + USER_TOOLS:
            self.assertEqual(_schema_of(server, name), {"type": "object", "properties": {}})

    def test_stock_tools_fit_one_page(self):
        self.assertNotIn("nextCursor", list_page(_registered(HalFake()), with_user_tools=True))


class DeviceStatusTest(TestCase):
    def test_full_status(self):
        hal = HalFake(ssid="home", rssi=-65, chip_temperature=39.5)
        hal.set_volume(33)
        hal.set_brightness(12)
        hal.set_theme("dark")
        status = json.loads(tool_text(call_tool(_registered(hal), "self.get_device_status")))
        self.assertEqual(
            status,
            {
                "audio_speaker": {"volume": 33},
                "screen": {"brightness": 12, "theme": "dark"},
                "network": {"type": "wifi", "ssid": "home", "signal": "medium"},
                "chip": {"temperature": 39.5},
            },
        )

    def test_keys_absent_without_hardware(self):
        hal = HalFake(features=(), chip_temperature=None, ssid="lab", rssi=-40)
        status = json.loads(tool_text(call_tool(_registered(hal), "self.get_device_status")))
        self.assertEqual(status, {"network": {"type": "wifi", "ssid": "lab", "signal": "strong"}})

    def test_screen_with_theme_only(self):
        hal = HalFake(features=["theme"])
        status = json.loads(tool_text(call_tool(_registered(hal), "self.get_device_status")))
        self.assertEqual(status["screen"], {"theme": "light"})
        self.assertNotIn("audio_speaker", status)


class ControlToolsTest(TestCase):
    def setUp(self):
        self.hal = HalFake()
        self.server = _registered(self.hal)

    def test_set_volume_is_visible_in_the_hal(self):
        reply = call_tool(self.server, "self.audio_speaker.set_volume", {"volume": 55})
        self.assertEqual(tool_text(reply), "true")
        self.assertEqual(self.hal.get_volume(), 55)
        self.assertEqual(self.hal.changes, [("volume", 55)])
        status = json.loads(tool_text(call_tool(self.server, "self.get_device_status")))
        self.assertEqual(status["audio_speaker"], {"volume": 55})

    def test_out_of_range_volume_changes_nothing(self):
        reply = call_tool(self.server, "self.audio_speaker.set_volume", {"volume": 101})
        self.assertEqual(error_of(reply), (INVALID_PARAMS, "Value exceeds maximum allowed: 100"))
        reply = call_tool(self.server, "self.audio_speaker.set_volume", {})
        self.assertEqual(error_of(reply), (INVALID_PARAMS, "Missing valid argument: volume"))
        self.assertEqual(self.hal.changes, [])
        self.assertEqual(self.hal.get_volume(), 70)

    def test_set_brightness(self):
        reply = call_tool(self.server, "self.screen.set_brightness", {"brightness": 5.9})
        self.assertEqual(tool_text(reply), "true")
        self.assertEqual(self.hal.changes, [("brightness", 5)])

    def test_set_theme(self):
        reply = call_tool(self.server, "self.screen.set_theme", {"theme": "dark"})
        self.assertEqual(tool_text(reply), "true")
        self.assertEqual(self.hal.get_theme(), "dark")

    def test_unknown_theme_answers_false(self):
        reply = call_tool(self.server, "self.screen.set_theme", {"theme": "sepia"})
        self.assertEqual(tool_text(reply), "false")
        self.assertEqual(self.hal.get_theme(), "light")
        self.assertEqual(self.hal.changes, [])

    def test_led_default_brightness(self):
        self.assertEqual(tool_text(call_tool(self.server, "self.led.set", {"on": True})), "true")
        self.assertEqual(self.hal.get_led(), {"on": True, "brightness": 100})
        call_tool(self.server, "self.led.set", {"on": False, "brightness": 30})
        self.assertEqual(self.hal.get_led(), {"on": False, "brightness": 30})

    def test_led_needs_a_boolean(self):
        reply = call_tool(self.server, "self.led.set", {"on": 1})
        self.assertEqual(error_of(reply), (INVALID_PARAMS, "Missing valid argument: on"))

    def test_system_info(self):
        text = tool_text(call_tool(self.server, "self.get_system_info"))
        self.assertEqual(json.loads(text), self.hal.system_info())

    def test_reboot(self):
        self.assertEqual(tool_text(call_tool(self.server, "self.reboot")), "true")
        self.assertEqual(self.hal.reboots, 1)
        self.assertEqual(self.hal.changes, [("reboot", 1)])
