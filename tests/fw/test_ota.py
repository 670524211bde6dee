import ota
from hal_fake import HalFake
from tinytest import TestCase


class UrlTest(TestCase):
    def test_parse_http_url(self):
        self.assertEqual(
            ota.parse_http_url("http://192.168.1.10:8002/xiaozhi/ota/"),
            ("192.168.1.10", 8002, "/xiaozhi/ota/"),
        )
        self.assertEqual(ota.parse_http_url("http://bridge"), ("bridge", 80, "/"))
        for bad in ("https://bridge/ota/", "ws://b/", "http://:80/", "http://b:0/", "http://u@b/"):
            self.assertRaises(ValueError, ota.parse_http_url, bad)

    def test_activate_url_inserts_a_slash_when_missing(self):
        self.assertEqual(ota.activate_url("http://b/xiaozhi/ota/"), "http://b/xiaozhi/ota/activate")
        self.assertEqual(ota.activate_url("http://b/xiaozhi/ota"), "http://b/xiaozhi/ota/activate")


class VersionTest(TestCase):
    def test_dot_separated_integers_only(self):
        self.assertEqual(ota.version_tuple("2.4.10"), (2, 4, 10))
        for bad in ("", "v1", "2.4.2-sim", "2..4", None, 3):
            self.assertIsNone(ota.version_tuple(bad))

    def test_is_newer_compares_numbers_not_text(self):
        self.assertTrue(ota.is_newer("2.4.10", "2.4.9"))
        self.assertTrue(ota.is_newer("1.0.1", "1.0"))
        self.assertFalse(ota.is_newer("1.0.0", "1"))
        self.assertFalse(ota.is_newer("2.4.2", "2.4.2"))
        self.assertFalse(ota.is_newer("2.4.1", "2.4.2"))
        self.assertFalse(ota.is_newer("2.5.0", "2.4.2-sim"))  # never upgrade on a guess


class AnswerTest(TestCase):
    def test_offered_update_needs_a_url_and_a_newer_version(self):
        offer = {"firmware": {"version": "0.2.0", "url": "http://b/f", "sha256": "ab"}}
        self.assertEqual(ota.offered_update(offer, "0.1.0"), offer["firmware"])
        self.assertIsNone(ota.offered_update(offer, "0.2.0"))
        self.assertIsNone(ota.offered_update({"firmware": {"version": "9.0", "url": ""}}, "1.0"))
        self.assertIsNone(ota.offered_update({}, "1.0"))

    def test_websocket_endpoint(self):
        answer = {"websocket": {"url": "ws://b:8000/xiaozhi/v1/", "token": "dtk_x", "version": 1}}
        self.assertEqual(ota.websocket_endpoint(answer), ("ws://b:8000/xiaozhi/v1/", "dtk_x"))
        self.assertRaises(ota.OtaError, ota.websocket_endpoint, {"activation": {"code": "1"}})

    def test_mqtt_settings_take_the_login_and_topics_from_the_answer(self):
        section = {
            "endpoint": "b:1883",
            "client_id": "GID_xiaozhi@@@02_00_00_00_00_01@@@uuid-1",
            "username": "02_00_00_00_00_01",
            "password": "dtk_x",
            "keepalive": 240,
            "publish_topic": "fleet/02_00_00_00_00_01/up",
            "subscribe_topic": "fleet/02_00_00_00_00_01/down",
            "unknown": "kept out",
        }
        local = {"url": "mqtt://old:1", "password": "stale", "keepalive": 30, "stock": False}
        settings = ota.mqtt_settings({"mqtt": section}, local)
        self.assertEqual(
            settings,
            {
                "url": "mqtt://b:1883",
                "client_id": section["client_id"],
                "username": "02_00_00_00_00_01",
                "password": "dtk_x",
                "keepalive": 30,
                "stock": False,
                "publish_topic": "fleet/02_00_00_00_00_01/up",
                "subscribe_topic": "fleet/02_00_00_00_00_01/down",
                "status_topic": "fleet/02_00_00_00_00_01/status",
            },
        )
        self.assertEqual(local["url"], "mqtt://old:1")  # the device's own config is not changed
        self.assertEqual(ota.mqtt_settings({"mqtt": section})["keepalive"], 240)

    def test_mqtt_settings_follow_the_stock_port_rule(self):
        login = {"username": "k", "password": "dtk_x"}
        for endpoint, url in (
            ("b", "mqtts://b:8883"),
            ("b:8883", "mqtts://b:8883"),
            ("b:1884", "mqtt://b:1884"),
        ):
            answer = {"mqtt": dict(login, endpoint=endpoint)}
            self.assertEqual(ota.mqtt_settings(answer)["url"], url)

    def test_mqtt_settings_refuse_an_unusable_section(self):
        section = {"endpoint": "b:1883", "username": "k", "password": "dtk_x"}
        self.assertRaises(ota.OtaError, ota.mqtt_settings, {"websocket": {"url": "ws://b/"}})
        self.assertRaises(ota.OtaError, ota.mqtt_settings, {"mqtt": dict(section, password="")})
        self.assertRaises(ota.OtaError, ota.mqtt_settings, {"mqtt": dict(section, endpoint=":1")})
        self.assertRaises(ota.OtaError, ota.mqtt_settings, {"mqtt": dict(section, endpoint="b:x")})

    def test_request_headers_are_the_stock_ones(self):
        hal = HalFake(board_name="my-board", firmware_version="0.1.0")
        headers = ota.request_headers("02:00:00:00:00:01", "uuid-1", "my-board/0.1.0")
        self.assertEqual(headers["Device-Id"], "02:00:00:00:00:01")
        self.assertEqual(headers["Client-Id"], "uuid-1")
        self.assertEqual(headers["User-Agent"], "my-board/0.1.0")
        self.assertEqual(headers["Activation-Version"], "1")
        info = hal.system_info()
        self.assertEqual(info["application"]["version"], "0.1.0")
        self.assertIsInstance(info["minimum_free_heap_size"], str)


class BundleNameTest(TestCase):
    def test_names_stay_inside_the_firmware_folder(self):
        for good in ("main.py", "lib/app.mpy", "lib/sub-dir/x_1.mpy"):
            self.assertTrue(ota._check_name(good), good)
        for bad in ("", "/main.py", "../x", "lib/../../x", "lib//x", "a b", "lib/x;rm", "./x"):
            self.assertFalse(ota._check_name(bad), bad)
