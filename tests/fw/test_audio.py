import struct
import sys

import audio
import compat
from tinytest import TestCase

WAV_PATH = "test_audio_tmp.wav"


def _pcm(*samples) -> bytearray:
    return bytearray(struct.pack("<%dh" % len(samples), *samples))


def _samples(buf):
    return list(struct.unpack("<%dh" % (len(buf) // 2), bytes(buf)))


def _remove(path):
    import os

    try:
        os.remove(path)
    except OSError:
        pass


class VolumeTest(TestCase):
    def test_known_samples_at_half_volume(self):
        buf = _pcm(1000, -1000, 32767, -32768, 0, 1, -1)
        audio.apply_volume(buf, 50)
        self.assertEqual(_samples(buf), [500, -500, 16383, -16384, 0, 0, -1])

    def test_quarter_and_ninety_percent(self):
        buf = _pcm(4000, -4000)
        audio.apply_volume(buf, 25)
        self.assertEqual(_samples(buf), [1000, -1000])
        buf = _pcm(25600, -25600)
        audio.apply_volume(buf, 90)  # gain 230/256
        self.assertEqual(_samples(buf), [23000, -23000])

    def test_full_volume_leaves_the_samples_and_zero_silences(self):
        loud = _pcm(12345, -23456, 32767)
        audio.apply_volume(loud, 100)
        self.assertEqual(_samples(loud), [12345, -23456, 32767])
        audio.apply_volume(loud, 0)
        self.assertEqual(_samples(loud), [0, 0, 0])

    def test_a_whole_frame(self):
        frame = bytearray(audio.FRAME_BYTES)
        for i in range(audio.FRAME_SAMPLES):
            struct.pack_into("<h", frame, 2 * i, (i * 67) % 65536 - 32768)
        expected = [((i * 67) % 65536 - 32768) * 128 >> 8 for i in range(audio.FRAME_SAMPLES)]
        audio.apply_volume(frame, 50)
        self.assertEqual(_samples(frame), expected)

    def test_gain_is_clamped(self):
        self.assertEqual(audio.gain_of(100), 256)
        self.assertEqual(audio.gain_of(150), 256)
        self.assertEqual(audio.gain_of(-5), 0)

    def test_viper_exactly_where_the_port_has_it(self):
        # The unix port (like the ESP32) compiles the viper code; CPython runs the same source
        # through the shim; the wasm port (no native emitter) has the portable loops.
        self.assertEqual(audio.NATIVE, sys.platform != "webassembly")
        self.assertEqual(compat.NATIVE_MASK, audio.NATIVE and compat.MICROPYTHON)


class Pcm32Test(TestCase):
    def test_keeps_the_top_16_bits(self):
        src = bytearray(struct.pack("<4i", 1000 << 16, (-1000 << 16) | 0x1234, -(1 << 31), 0xFF))
        dst = bytearray(8)
        self.assertEqual(audio.pcm32_to_pcm16(src, dst), 4)
        self.assertEqual(_samples(dst), [1000, -1000, -32768, 0])

    def test_stops_at_the_shorter_buffer(self):
        src = bytearray(struct.pack("<3i", 1 << 16, 2 << 16, 3 << 16))
        dst = bytearray(4)
        self.assertEqual(audio.pcm32_to_pcm16(src, dst), 2)
        self.assertEqual(_samples(dst), [1, 2])


class FrameQueueTest(TestCase):
    def test_bounded_fifo_drops_the_excess(self):
        queue = audio.FrameQueue(3)
        results = [queue.push(bytes([n])) for n in range(5)]
        self.assertEqual(results, [True, True, True, False, False])
        self.assertEqual((len(queue), queue.dropped), (3, 2))
        self.assertEqual([queue.pop() for _ in range(4)], [b"\x00", b"\x01", b"\x02", None])

    def test_default_bound_is_the_stock_40(self):
        queue = audio.FrameQueue()
        for n in range(45):
            queue.push(b"x")
        self.assertEqual((len(queue), queue.dropped), (40, 5))
        queue.clear()
        self.assertEqual(len(queue), 0)


class WavTest(TestCase):
    def tearDown(self):
        _remove(WAV_PATH)

    def test_header_layout(self):
        header = audio.wav_header(16000, 1920)
        self.assertEqual(len(header), 44)
        self.assertEqual(header[:4], b"RIFF")
        self.assertEqual(struct.unpack("<I", header[4:8])[0], 36 + 1920)
        self.assertEqual(header[8:16], b"WAVEfmt ")
        self.assertEqual(struct.unpack("<IHHIIHH", header[16:36]), (16, 1, 1, 16000, 32000, 2, 16))
        self.assertEqual(header[36:40], b"data")
        self.assertEqual(struct.unpack("<I", header[40:44])[0], 1920)

    def test_written_file_reads_back_in_frames(self):
        writer = audio.WavWriter(WAV_PATH, 24000)
        writer.write(_pcm(1, 2, 3))
        writer.write(_pcm(-4, 5))
        writer.close()
        reader = audio.WavReader(WAV_PATH)
        self.assertEqual((reader.sample_rate, reader.data_size), (24000, 10))
        buf = bytearray(6)
        self.assertEqual(reader.readinto(buf), 6)
        self.assertEqual(_samples(buf), [1, 2, 3])
        self.assertEqual(reader.readinto(buf), 4)
        self.assertEqual(_samples(buf[:4]), [-4, 5])
        self.assertEqual(reader.readinto(buf), 0)
        reader.close()

    def test_flush_makes_the_file_complete_while_writing(self):
        writer = audio.WavWriter(WAV_PATH, 16000)
        writer.write(_pcm(7, 8))
        writer.flush()
        with open(WAV_PATH, "rb") as file:
            data = file.read()
        self.assertEqual(data, audio.wav_header(16000, 4) + bytes(_pcm(7, 8)))
        writer.write(_pcm(9))
        writer.close()
        with open(WAV_PATH, "rb") as file:
            self.assertEqual(file.read(), audio.wav_header(16000, 6) + bytes(_pcm(7, 8, 9)))

    def test_skips_chunks_before_data(self):
        fmt = struct.pack("<IHHIIHH", 16, 1, 1, 16000, 32000, 2, 16)
        body = b"WAVEfmt " + fmt + b"LIST" + struct.pack("<I", 3) + b"abc\x00"
        body += b"data" + struct.pack("<I", 2) + b"\x10\x00"
        self._write(b"RIFF" + struct.pack("<I", len(body)) + body)
        reader = audio.WavReader(WAV_PATH)
        buf = bytearray(4)
        self.assertEqual((reader.sample_rate, reader.readinto(buf)), (16000, 2))
        reader.close()

    def test_rejects_what_it_cannot_play(self):
        stereo = struct.pack("<IHHIIHH", 16, 1, 2, 16000, 64000, 4, 16)
        eight_bit = struct.pack("<IHHIIHH", 16, 1, 1, 16000, 16000, 1, 8)
        for fmt in (stereo, eight_bit):
            body = b"WAVEfmt " + fmt + b"data" + struct.pack("<I", 0)
            self._write(b"RIFF" + struct.pack("<I", len(body)) + body)
            with self.assertRaises(ValueError):
                audio.WavReader(WAV_PATH)
        for junk in (b"", b"RIFX1234WAVE", b"RIFF\x04\x00\x00\x00WAVE"):
            self._write(junk)
            with self.assertRaises(ValueError):
                audio.WavReader(WAV_PATH)

    def _write(self, data):
        with open(WAV_PATH, "wb") as file:
            file.write(data)


class FrameSizeTest(TestCase):
    def test_frame_sizes(self):
        self.assertEqual(audio.frame_bytes(16000), audio.FRAME_BYTES)
        self.assertEqual(audio.frame_bytes(24000), 2880)
        self.assertEqual(audio.FRAME_SAMPLES * 2, audio.FRAME_BYTES)
