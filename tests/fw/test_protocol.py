import json

import protocol
from tinytest import TestCase


class BuildersTest(TestCase):
    def test_device_hello(self):
        hello = json.loads(protocol.device_hello())
        self.assertEqual(
            hello,
            {
                "type": "hello",
                "version": 1,
                "features": {"mcp": True},
                "transport": "websocket",
                "audio_params": {
                    "format": "opus",
                    "sample_rate": 16000,
                    "channels": 1,
                    "frame_duration": 60,
                },
            },
        )

    def test_device_hello_options(self):
        hello = json.loads(protocol.device_hello(version=3, transport="udp", mcp=False))
        self.assertEqual((hello["version"], hello["transport"]), (3, "udp"))
        self.assertEqual(hello["features"], {"mcp": False})

    def test_builders_emit_compact_json(self):
        for text in (
            protocol.device_hello(),
            protocol.listen_start("s1", "manual"),
            protocol.mcp_envelope("s1", {"jsonrpc": "2.0", "id": 1, "result": {}}),
        ):
            self.assertNotIn(" ", text)

    def test_mcp_envelope(self):
        payload = {"jsonrpc": "2.0", "id": 3, "result": {"content": [], "isError": False}}
        message = json.loads(protocol.mcp_envelope("abc", payload))
        self.assertEqual(message, {"session_id": "abc", "type": "mcp", "payload": payload})

    def test_listen_messages(self):
        self.assertEqual(
            json.loads(protocol.listen_detect("s", "turn on the light")),
            {"session_id": "s", "type": "listen", "state": "detect", "text": "turn on the light"},
        )
        self.assertEqual(
            json.loads(protocol.listen_start("s")),
            {"session_id": "s", "type": "listen", "state": "start", "mode": "auto"},
        )
        for mode in ("manual", "realtime"):
            self.assertEqual(json.loads(protocol.listen_start("s", mode))["mode"], mode)
        self.assertEqual(
            json.loads(protocol.listen_stop("")),
            {"session_id": "", "type": "listen", "state": "stop"},
        )

    def test_listen_start_rejects_unknown_mode(self):
        with self.assertRaises(ValueError) as context:
            protocol.listen_start("s", "push")
        self.assertIn("push", str(context.exception))

    def test_abort(self):
        self.assertEqual(json.loads(protocol.abort("s")), {"session_id": "s", "type": "abort"})
        self.assertEqual(
            json.loads(protocol.abort("s", "wake_word_detected")),
            {"session_id": "s", "type": "abort", "reason": "wake_word_detected"},
        )

    def test_strings_are_escaped(self):
        session_id = 'a"b\\c\n'
        text = 'say "hi" \\ bye'
        message = json.loads(protocol.listen_detect(session_id, text))
        self.assertEqual((message["session_id"], message["text"]), (session_id, text))


class ParseTest(TestCase):
    def test_valid_message(self):
        self.assertEqual(
            protocol.parse('{"type":"tts","state":"start"}'), {"type": "tts", "state": "start"}
        )

    def test_bytes(self):
        self.assertEqual(protocol.parse(b'{"type":"stt","text":"hi"}')["text"], "hi")
        self.assertEqual(protocol.parse(bytearray(b'{"type":"x"}')), {"type": "x"})

    def test_unusable_input_gives_none(self):
        for text in (
            "",
            "{",
            "null",
            "[1]",
            '"hello"',
            "{}",
            '{"type":5}',
            '{"type":null}',
            b"\xff\xfe\xfd",
            None,
            42,
        ):
            self.assertIsNone(protocol.parse(text), text)


class ServerHelloTest(TestCase):
    def test_websocket_hello(self):
        hello = {"type": "hello", "transport": "websocket", "session_id": "x"}
        self.assertTrue(protocol.is_server_hello(hello))

    def test_transport_must_match(self):
        self.assertFalse(protocol.is_server_hello({"type": "hello"}))
        self.assertFalse(protocol.is_server_hello({"type": "hello", "transport": "udp"}))
        self.assertFalse(protocol.is_server_hello({"type": "hello", "transport": 1}))
        udp = {"type": "hello", "transport": "udp"}
        self.assertTrue(protocol.is_server_hello(udp, transport="udp"))

    def test_other_messages(self):
        self.assertFalse(protocol.is_server_hello({"type": "tts", "transport": "websocket"}))
        self.assertFalse(protocol.is_server_hello(None))
        self.assertFalse(protocol.is_server_hello('{"type":"hello","transport":"websocket"}'))


class HandshakeHeadersTest(TestCase):
    def test_bearer_token(self):
        headers = protocol.handshake_headers("abc", "a4:cf:12:34:56:78", "uuid-1")
        self.assertEqual(
            headers,
            {
                "Authorization": "Bearer abc",
                "Protocol-Version": "1",
                "Device-Id": "a4:cf:12:34:56:78",
                "Client-Id": "uuid-1",
            },
        )

    def test_token_with_space_is_sent_verbatim(self):
        headers = protocol.handshake_headers("Basic xyz", "d", "c")
        self.assertEqual(headers["Authorization"], "Basic xyz")

    def test_no_token_no_authorization(self):
        for token in ("", None):
            self.assertNotIn("Authorization", protocol.handshake_headers(token, "d", "c"))

    def test_protocol_version(self):
        self.assertEqual(protocol.handshake_headers("", "d", "c", 3)["Protocol-Version"], "3")
        self.assertEqual(protocol.handshake_headers("", "d", "c", 0)["Protocol-Version"], "1")


class WifiSignalTest(TestCase):
    def test_stock_thresholds(self):
        cases = ((-30, "strong"), (-60, "strong"), (-61, "medium"), (-70, "medium"))
        cases += ((-71, "weak"), (-95, "weak"))
        for rssi, label in cases:
            self.assertEqual(protocol.wifi_signal(rssi), label, rssi)


class AudioFramingTest(TestCase):
    PCM = bytes(range(256)) * 7 + b"\x01\x02"

    def test_pcm16_hello(self):
        hello = json.loads(protocol.device_hello(3, audio_params=protocol.PCM16_PARAMS))
        self.assertEqual(
            hello["audio_params"],
            {"format": "pcm16", "sample_rate": 16000, "channels": 1, "frame_duration": 60},
        )

    def test_version_1_is_the_raw_payload(self):
        self.assertEqual(protocol.pack_audio(1, self.PCM), self.PCM)
        self.assertEqual(protocol.unpack_audio(1, self.PCM), self.PCM)

    def test_version_2_header(self):
        packed = protocol.pack_audio(2, self.PCM, 1234)
        header = b"\x00\x02\x00\x00\x00\x00\x00\x00\x00\x00\x04\xd2\x00\x00\x07\x02"
        self.assertEqual(packed, header + self.PCM)
        self.assertEqual(protocol.unpack_audio(2, packed), self.PCM)

    def test_version_3_header(self):
        packed = protocol.pack_audio(3, self.PCM)
        self.assertEqual(packed, b"\x00\x00\x07\x02" + self.PCM)
        self.assertEqual(protocol.unpack_audio(3, packed), self.PCM)

    def test_a_size_that_does_not_match_gives_none(self):
        for version in (2, 3):
            packed = protocol.pack_audio(version, self.PCM)
            self.assertIsNone(protocol.unpack_audio(version, packed[:-1]), version)
            self.assertIsNone(protocol.unpack_audio(version, packed + b"x"), version)
            self.assertIsNone(protocol.unpack_audio(version, b"\x00\x00"), version)

    def test_downlink_audio_of_a_server_hello(self):
        pcm = {"audio_params": {"format": "pcm16", "sample_rate": 16000}}
        self.assertEqual(protocol.downlink_audio(pcm), ("pcm16", 16000))
        self.assertEqual(protocol.downlink_audio({}), ("opus", 24000))
        odd = {"audio_params": {"format": 3, "sample_rate": "fast"}}
        self.assertEqual(protocol.downlink_audio(odd), ("opus", 24000))
