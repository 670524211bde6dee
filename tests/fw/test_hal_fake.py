from hal_fake import ALL_FEATURES, HISTORY, HalFake
from tinytest import TestCase


class FeaturesTest(TestCase):
    def test_all_features_by_default(self):
        hal = HalFake()
        for feature in ("speaker", "backlight", "theme", "led"):
            self.assertTrue(hal.has(feature), feature)
        self.assertFalse(hal.has("camera"))
        self.assertEqual(hal.features, ALL_FEATURES)

    def test_chosen_features(self):
        hal = HalFake(features=["led"])
        self.assertTrue(hal.has("led"))
        self.assertFalse(hal.has("speaker"))


class StateChangesTest(TestCase):
    def setUp(self):
        self.events = []
        self.hal = HalFake(on_change=lambda what, value: self.events.append((what, value)))

    def test_setters_change_state_and_record_in_order(self):
        hal = self.hal
        hal.set_volume(55)
        hal.set_brightness(0)
        self.assertTrue(hal.set_theme("dark"))
        hal.set_led(True, 40)
        hal.show("assistant", "hello")
        hal.reboot()
        expected = [
            ("volume", 55),
            ("brightness", 0),
            ("theme", "dark"),
            ("led", {"on": True, "brightness": 40}),
            ("show", ("assistant", "hello")),
            ("reboot", 1),
        ]
        self.assertEqual(hal.changes, expected)
        self.assertEqual(self.events, expected)
        self.assertEqual((hal.get_volume(), hal.get_brightness(), hal.get_theme()), (55, 0, "dark"))
        self.assertEqual(hal.get_led(), {"on": True, "brightness": 40})
        self.assertEqual(hal.shown, [("assistant", "hello")])
        self.assertEqual(hal.reboots, 1)

    def test_unknown_theme_is_refused_without_change(self):
        self.assertFalse(self.hal.set_theme("sepia"))
        self.assertEqual(self.hal.get_theme(), "light")
        self.assertEqual(self.hal.changes, [])

    def test_out_of_contract_values_raise(self):
        hal = self.hal
        for value in (101, -1, True, "50", 50.0, None):
            self.assertRaises(ValueError, hal.set_volume, value)
            self.assertRaises(ValueError, hal.set_brightness, value)
            self.assertRaises(ValueError, hal.set_led, True, value)
        self.assertRaises(ValueError, hal.set_led, 1, 50)
        self.assertRaises(ValueError, hal.show, "narrator", "x")
        self.assertEqual(hal.changes, [])
        self.assertEqual(self.events, [])
        self.assertEqual(hal.get_volume(), 70)

    def test_works_without_callback(self):
        hal = HalFake()
        hal.set_volume(1)
        self.assertEqual(hal.changes, [("volume", 1)])

    def test_history_keeps_only_the_latest_entries(self):
        hal = HalFake()
        for step in range(HISTORY + 5):
            hal.set_volume(step)
        self.assertEqual(hal.changes, [("volume", step) for step in range(5, HISTORY + 5)])
        for step in range(HISTORY + 3):
            hal.show("system", str(step))
        self.assertEqual(hal.shown, [("system", str(step)) for step in range(3, HISTORY + 3)])
        self.assertEqual(len(hal.changes), HISTORY)
        self.assertEqual(hal.get_volume(), HISTORY + 4)


class ReadoutsTest(TestCase):
    def test_network_status(self):
        self.assertEqual(
            HalFake(ssid="home", rssi=-65).network_status(),
            {"type": "wifi", "ssid": "home", "signal": "medium"},
        )
        self.assertEqual(HalFake(rssi=-80).network_status()["signal"], "weak")

    def test_optional_readouts(self):
        self.assertEqual(HalFake(chip_temperature=38.0).chip_temperature(), 38.0)
        self.assertIsNone(HalFake(chip_temperature=None).chip_temperature())
        self.assertEqual(HalFake(free_memory=12345).free_memory(), 12345)
        self.assertIsNone(HalFake().free_memory())

    def test_system_info_shape(self):
        hal = HalFake(board_name="sim-board", firmware_version="9.8.7", free_memory=4096)
        info = hal.system_info()
        self.assertEqual(info["mac_address"], hal.mac)
        self.assertEqual(info["uuid"], hal.client_id)
        self.assertEqual(info["minimum_free_heap_size"], "4096")
        self.assertEqual(info["application"]["version"], "9.8.7")
        self.assertEqual(info["board"]["type"], "sim-board")
        self.assertIsInstance(info["flash_size"], int)
