import sys

import compat
from tinytest import TestCase


def _reference_mask(data, key):
    return bytearray(data[i] ^ key[i % 4] for i in range(len(data)))


class MaskTest(TestCase):
    def test_matches_a_plain_xor_for_every_length_mod_4(self):
        key = b"\x9a\x01\xff\x37"
        for length in range(0, 13):
            data = bytes((i * 37 + 11) & 0xFF for i in range(length))
            self.assertEqual(compat.mask(data, key), _reference_mask(data, key), length)

    def test_is_its_own_inverse_on_a_frame(self):
        key = bytearray(b"\x10\x20\x30\x40")
        frame = bytes(range(256)) * 8
        masked = compat.mask(frame, key)
        self.assertIsInstance(masked, bytearray)
        self.assertNotEqual(bytes(masked), frame)
        self.assertEqual(bytes(compat.mask(masked, key)), frame)

    def test_leaves_the_input_alone(self):
        data = bytearray(b"abcd")
        compat.mask(data, b"\x01\x01\x01\x01")
        self.assertEqual(data, bytearray(b"abcd"))

    def test_native_code_exactly_where_the_port_has_it(self):
        # The unix port (like the ESP32) has viper; CPython and the wasm port use plain code.
        expected = compat.MICROPYTHON and sys.platform != "webassembly"
        self.assertEqual(compat.NATIVE_MASK, expected)


class TicksTest(TestCase):
    def test_ticks_diff_is_signed(self):
        # The wrap period differs per port (2**30 on the ESP32), so only in-range values here.
        self.assertEqual(compat.ticks_diff(1000, 400), 600)
        self.assertEqual(compat.ticks_diff(400, 1000), -600)

    def test_ticks_ms_is_an_int(self):
        self.assertIsInstance(compat.ticks_ms(), int)

    def test_const_is_the_value(self):
        self.assertEqual(compat.const(42), 42)

    def test_runtime_flag(self):
        self.assertEqual(compat.MICROPYTHON, sys.implementation.name == "micropython")
