"""Pure framing helpers of transport_ws: frames, masking, URLs and the upgrade request.

Runs unchanged on CPython, the MicroPython unix port and the WebAssembly port (tinytest).
"""

from binascii import a2b_base64

import transport_ws as ws
from compat import mask
from tinytest import TestCase

# RFC 6455 §5.7 examples.
RFC_HELLO_UNMASKED = b"\x81\x05Hello"
RFC_HELLO_MASKED = b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58"
RFC_KEY = b"\x37\xfa\x21\x3d"


class FrameChunksTest(TestCase):
    def test_a_frame_with_a_small_body_is_one_write(self):
        for size in (0, 5, 126, ws.JOIN_MAX):
            payload = b"x" * size
            chunks = ws.frame_chunks(ws.OP_TEXT, payload, RFC_KEY)
            self.assertEqual(len(chunks), 1, size)
            self.assertEqual(chunks[0], ws.build_frame(ws.OP_TEXT, payload, RFC_KEY))

    def test_a_larger_body_is_written_after_its_header_uncopied(self):
        payload = b"y" * (ws.JOIN_MAX + 1)
        head, body = ws.frame_chunks(ws.OP_BINARY, payload, RFC_KEY)
        self.assertEqual(len(head), 2 + 2 + 4)
        self.assertEqual(len(body), len(payload))
        self.assertEqual(head + body, ws.build_frame(ws.OP_BINARY, payload, RFC_KEY))


class FrameBuildTest(TestCase):
    def test_rfc_unmasked_text_frame(self):
        self.assertEqual(ws.build_frame(ws.OP_TEXT, b"Hello"), RFC_HELLO_UNMASKED)

    def test_rfc_masked_text_frame(self):
        self.assertEqual(ws.build_frame(ws.OP_TEXT, b"Hello", RFC_KEY), RFC_HELLO_MASKED)

    def test_length_125_fits_the_first_header(self):
        frame = ws.build_frame(ws.OP_BINARY, bytes(125))
        self.assertEqual(frame[:2], b"\x82\x7d")
        self.assertEqual(len(frame), 2 + 125)

    def test_length_126_uses_the_16_bit_length(self):
        frame = ws.build_frame(ws.OP_BINARY, bytes(126))
        self.assertEqual(frame[:4], b"\x82\x7e\x00\x7e")
        self.assertEqual(len(frame), 4 + 126)

    def test_length_65535_is_the_largest_16_bit_length(self):
        frame = ws.build_frame(ws.OP_TEXT, bytes(65535), b"abcd")
        self.assertEqual(frame[:4], b"\x81\xfe\xff\xff")
        self.assertEqual(frame[4:8], b"abcd")
        self.assertEqual(len(frame), 8 + 65535)

    def test_length_65536_uses_the_64_bit_length(self):
        frame = ws.build_frame(ws.OP_BINARY, bytes(65536))
        self.assertEqual(frame[:10], b"\x82\x7f\x00\x00\x00\x00\x00\x01\x00\x00")
        self.assertEqual(len(frame), 10 + 65536)

    def test_control_frames(self):
        self.assertEqual(ws.build_frame(ws.OP_CLOSE, b"\x03\xe8"), b"\x88\x02\x03\xe8")
        self.assertEqual(ws.build_frame(ws.OP_PONG, b""), b"\x8a\x00")


class MaskTest(TestCase):
    def test_rfc_mask_vector(self):
        self.assertEqual(bytes(mask(b"Hello", RFC_KEY)), RFC_HELLO_MASKED[6:])

    def test_mask_round_trip_at_odd_lengths(self):
        key = b"\x01\x80\xfe\x7f"
        for size in (0, 1, 3, 4, 5, 1920, 1923):
            data = bytes(i & 0xFF for i in range(size))
            masked = mask(data, key)
            self.assertEqual(len(masked), size)
            if size >= 4:
                self.assertNotEqual(bytes(masked), data)
            self.assertEqual(bytes(mask(masked, key)), data)

    def test_mask_leaves_the_input_alone(self):
        data = bytearray(b"abcdef")
        mask(data, b"\xff\xff\xff\xff")
        self.assertEqual(data, bytearray(b"abcdef"))


class FrameParseTest(TestCase):
    def test_parse_rfc_frames(self):
        self.assertEqual(ws.parse_frame(RFC_HELLO_UNMASKED), (True, ws.OP_TEXT, b"Hello", 7))
        self.assertEqual(ws.parse_frame(RFC_HELLO_MASKED), (True, ws.OP_TEXT, b"Hello", 11))

    def test_round_trip_at_length_boundaries(self):
        for size in (0, 125, 126, 65535, 65536):
            payload = bytes(i & 0xFF for i in range(size))
            for key in (None, b"\x0f\x1e\x2d\x3c"):
                frame = ws.build_frame(ws.OP_BINARY, payload, key)
                fin, opcode, parsed, used = ws.parse_frame(frame + b"\x81")
                self.assertTrue(fin)
                self.assertEqual(opcode, ws.OP_BINARY)
                self.assertEqual(parsed, payload)
                self.assertEqual(used, len(frame))

    def test_incomplete_frames_need_more_bytes(self):
        frame = ws.build_frame(ws.OP_TEXT, b"x" * 300, b"wxyz")
        for cut in (0, 1, 2, 3, 4, 7, len(frame) - 1):
            self.assertIsNone(ws.parse_frame(frame[:cut]))
        self.assertIsNotNone(ws.parse_frame(frame))

    def test_fragment_and_continuation_headers(self):
        self.assertEqual(ws.parse_frame(b"\x01\x03abc"), (False, ws.OP_TEXT, b"abc", 5))
        self.assertEqual(ws.parse_frame(b"\x80\x02de"), (True, ws.OP_CONTINUATION, b"de", 4))

    def test_header_size_from_the_second_byte(self):
        self.assertEqual(ws.header_size(0x05), 2)
        self.assertEqual(ws.header_size(0x85), 6)
        self.assertEqual(ws.header_size(0x7E), 4)
        self.assertEqual(ws.header_size(0xFE), 8)
        self.assertEqual(ws.header_size(0x7F), 10)
        self.assertEqual(ws.header_size(0xFF), 14)

    def test_parse_header_reads_the_mask_key(self):
        head = b"\x82\xfe\x01\x00" + b"KEY!"
        self.assertEqual(ws.parse_header(head), (True, ws.OP_BINARY, 256, b"KEY!"))

    def test_bad_headers_are_protocol_errors(self):
        bad = (
            (b"\xc1\x00", "reserved bits"),
            (b"\x83\x00", "opcode"),
            (b"\x8b\x00", "opcode"),
            (b"\x09\x00", "control frame"),
            (b"\x89\x7e\x00\x7e", "control frame"),
            (b"\x82\x7f\x80\x00\x00\x00\x00\x00\x00\x00", "top bit"),
        )
        for head, words in bad:
            with self.assertRaises(ws.ProtocolError) as context:
                ws.parse_header(head)
            self.assertIn(words, str(context.exception))
            self.assertEqual(context.exception.close_code, ws.CLOSE_PROTOCOL_ERROR)

    def test_close_code(self):
        self.assertEqual(ws.close_code_of(b"\x03\xe9bye"), 1001)
        self.assertEqual(ws.close_code_of(b""), 1005)


class UrlTest(TestCase):
    def test_stock_url(self):
        url = "ws://192.168.1.10:8000/xiaozhi/v1/"
        self.assertEqual(ws.parse_url(url), ("192.168.1.10", 8000, "/xiaozhi/v1/"))

    def test_default_port_and_path(self):
        self.assertEqual(ws.parse_url("ws://bridge.local"), ("bridge.local", 80, "/"))
        self.assertEqual(ws.parse_url("WS://h/"), ("h", 80, "/"))

    def test_query_is_kept_and_fragment_dropped(self):
        self.assertEqual(ws.parse_url("ws://h:81/p?a=1&b=2#frag"), ("h", 81, "/p?a=1&b=2"))
        self.assertEqual(ws.parse_url("ws://h?x=1"), ("h", 80, "/?x=1"))

    def test_bad_urls(self):
        bad = (
            ("wss://h/", "TLS not supported"),
            ("http://h/", "unsupported URL scheme"),
            ("h:80/path", "bad WebSocket URL"),
            ("ws:///path", "missing or bad host"),
            ("ws://h:0/", "bad port"),
            ("ws://h:65536/", "bad port"),
            ("ws://h:x/", "bad port"),
            ("ws://user@h/", "user info"),
            ("ws://h/a b", "bad characters"),
        )
        for url, words in bad:
            with self.assertRaises(ValueError) as context:
                ws.parse_url(url)
            self.assertIn(words, str(context.exception))
        self.assertRaises(ValueError, ws.parse_url, None)


class HandshakeTest(TestCase):
    def test_request_text(self):
        headers = {"Device-Id": "a4:cf:12:34:56:78"}
        request = ws.handshake_request(
            "10.0.0.2", "/xiaozhi/v1/", "S2V5S2V5S2V5S2V5S2V5Kg==", headers
        )
        expected = (
            b"GET /xiaozhi/v1/ HTTP/1.1\r\n"
            b"Host: 10.0.0.2\r\n"
            b"Upgrade: websocket\r\n"
            b"Connection: Upgrade\r\n"
            b"Sec-WebSocket-Key: S2V5S2V5S2V5S2V5S2V5Kg==\r\n"
            b"Sec-WebSocket-Version: 13\r\n"
            b"Device-Id: a4:cf:12:34:56:78\r\n"
            b"\r\n"
        )
        self.assertEqual(request, expected)

    def test_all_device_headers_are_sent(self):
        headers = {
            "Authorization": "Bearer t0k",
            "Protocol-Version": "1",
            "Device-Id": "a4:cf:12:34:56:78",
            "Client-Id": "c-1",
        }
        lines = ws.handshake_request("h", "/", "k", headers).split(b"\r\n")
        for name in headers:
            self.assertIn((name + ": " + headers[name]).encode(), lines)
        self.assertEqual(lines[-2:], [b"", b""])

    def test_header_injection_is_refused(self):
        for headers in ({"X": "a\r\nEvil: 1"}, {"Bad:Name": "v"}, {"": "v"}, {"X": "a\nb"}):
            self.assertRaises(ValueError, ws.handshake_request, "h", "/", "k", headers)

    def test_new_key_is_16_random_bytes(self):
        first, second = ws.new_key(), ws.new_key()
        self.assertEqual(len(a2b_base64(first.encode())), 16)
        self.assertNotEqual(first, second)

    def test_accept_value_rfc_vector(self):
        accept = ws.accept_value("dGhlIHNhbXBsZSBub25jZQ==")
        try:
            from hashlib import sha1  # noqa: F401
        except ImportError:  # the WebAssembly port: the check is skipped at run time
            self.assertIsNone(accept)
            return
        self.assertEqual(accept, "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")

    def test_handshake_error_carries_the_status(self):
        error = ws.HandshakeError(401, "Unauthorized")
        self.assertEqual(error.status, 401)
        self.assertEqual(str(error), "rejected: HTTP 401 (Unauthorized)")
        self.assertIsInstance(error, ValueError)
