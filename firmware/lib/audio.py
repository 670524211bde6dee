"""PCM16 audio for the firmware: frame sizes, software volume, 32-to-16-bit microphone samples,
the bounded downlink queue and a small WAV reader/writer (the fake HAL's microphone and speaker).

The firmware has no Opus codec, so it speaks PCM16 little-endian mono both ways: 16 kHz up,
the rate the server hello announces down, 60 ms frames. The per-sample loops are viper code
(audio_native) where the port has the native emitter; elsewhere (the WebAssembly port) the
portable loops below give the same results. Same code on the ESP32, the unix port and CPython.
"""

import struct

from compat import const

SAMPLE_RATE = const(16000)
FRAME_MS = const(60)
FRAME_SAMPLES = const(960)  # 60 ms at 16 kHz
FRAME_BYTES = const(1920)
QUEUE_FRAMES = const(40)  # the stock device's decode queue: 2.4 s

_WAV_HEADER = const(44)
_MAX_CHUNKS = const(16)  # chunks skipped before `data` (LIST, fact, ...) in a WAV file


def frame_bytes(sample_rate, frame_ms=FRAME_MS) -> int:
    """Bytes in one PCM16 mono frame."""
    return sample_rate * frame_ms // 1000 * 2


# ---- the sample loops ---------------------------------------------------------------------------


def _scale_portable(buf, samples, gain):
    for i in range(0, samples * 2, 2):
        sample = ((buf[i] | (buf[i + 1] << 8)) ^ 0x8000) - 0x8000
        value = ((sample * gain) >> 8) & 0xFFFF
        buf[i] = value & 0xFF
        buf[i + 1] = value >> 8


def _pcm32_portable(src, dst, samples):
    for i in range(samples):
        dst[2 * i] = src[4 * i + 2]
        dst[2 * i + 1] = src[4 * i + 3]


try:
    from audio_native import pcm32_to_pcm16 as _pcm32_kernel
    from audio_native import scale_pcm16 as _scale_kernel

    NATIVE = True  # viper here, or the same source through the CPython shim
except SyntaxError:  # no native emitter on this port (WebAssembly)
    _scale_kernel = _scale_portable
    _pcm32_kernel = _pcm32_portable
    NATIVE = False


def gain_of(volume) -> int:
    """The fixed-point gain (0..256) of a volume in percent."""
    return max(0, min(100, volume)) * 256 // 100


def apply_volume(buf, volume):
    """Scale the PCM16 samples of bytearray `buf` in place to `volume` percent (100: untouched)."""
    if volume >= 100:
        return
    _scale_kernel(buf, len(buf) // 2, gain_of(volume))


def pcm32_to_pcm16(src, dst) -> int:
    """The top 16 bits of each 32-bit sample of src into dst; returns the samples converted."""
    samples = min(len(src) // 4, len(dst) // 2)
    _pcm32_kernel(src, dst, samples)
    return samples


# ---- downlink queue -----------------------------------------------------------------------------


class FrameQueue:
    """FIFO of at most `limit` frames; a frame pushed onto a full queue is dropped and counted
    (the stock device does the same: no back-pressure, the server must pace)."""

    def __init__(self, limit=QUEUE_FRAMES):
        self.limit = limit
        self.dropped = 0
        self._frames = []

    def __len__(self) -> int:
        return len(self._frames)

    def push(self, frame) -> bool:
        if len(self._frames) >= self.limit:
            self.dropped += 1
            return False
        self._frames.append(frame)
        return True

    def pop(self):
        """The oldest frame, or None when empty."""
        return self._frames.pop(0) if self._frames else None

    def clear(self):
        self._frames = []


# ---- WAV files ----------------------------------------------------------------------------------


def wav_header(sample_rate, data_size) -> bytes:
    """The 44-byte header of a PCM16 mono WAV file holding data_size bytes of samples."""
    return (
        b"RIFF"
        + struct.pack("<I", 36 + data_size)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_size)
    )


def read_wav_header(stream):
    """(sample_rate, data_size) of a PCM16 mono WAV stream, left at the first sample; ValueError
    for anything else."""
    riff = stream.read(12)
    if len(riff) != 12 or riff[:4] != b"RIFF" or riff[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    sample_rate = None
    for _ in range(_MAX_CHUNKS):
        head = stream.read(8)
        if len(head) != 8:
            break
        kind, size = head[:4], struct.unpack("<I", head[4:])[0]
        if kind == b"data":
            if sample_rate is None:
                raise ValueError("WAV data before its fmt chunk")
            return sample_rate, size
        body = stream.read(size + (size & 1))  # chunks are padded to an even size
        if kind == b"fmt ":
            sample_rate = _pcm16_mono_rate(body)
    raise ValueError("WAV file has no data chunk")


def _pcm16_mono_rate(fmt) -> int:
    if len(fmt) < 16:
        raise ValueError("WAV fmt chunk too short")
    encoding, channels, rate, _, _, bits = struct.unpack("<HHIIHH", fmt[:16])
    if encoding != 1 or channels != 1 or bits != 16:
        raise ValueError(
            "WAV must be PCM 16-bit mono (format %d, %d channels, %d bits)"
            % (encoding, channels, bits)
        )
    return rate


class WavReader:
    """Samples of a PCM16 mono WAV file, frame by frame."""

    def __init__(self, path):
        self._file = open(path, "rb")
        try:
            self.sample_rate, self.data_size = read_wav_header(self._file)
        except BaseException:
            self._file.close()
            raise
        self.remaining = self.data_size

    def readinto(self, buf) -> int:
        """Fill buf with the next samples; the bytes read (fewer at the end, 0 after it)."""
        want = min(len(buf), self.remaining)
        if want <= 0:
            return 0
        got = self._file.readinto(memoryview(buf)[:want]) or 0
        self.remaining = self.remaining - got if got == want else 0  # a short file ends here
        return got

    def close(self):
        self._file.close()


class WavWriter:
    """A PCM16 mono WAV file written as it grows; flush() makes the file on disk complete."""

    def __init__(self, path, sample_rate):
        self.sample_rate = sample_rate
        self.data_size = 0
        self._file = open(path, "wb")
        self._file.write(wav_header(sample_rate, 0))

    def write(self, buf):
        self._file.write(buf)
        self.data_size += len(buf)

    def flush(self):
        """Fix up the header's sizes and push everything to the file."""
        self._file.seek(4)
        self._file.write(struct.pack("<I", 36 + self.data_size))
        self._file.seek(40)
        self._file.write(struct.pack("<I", self.data_size))
        self._file.seek(_WAV_HEADER + self.data_size)
        self._file.flush()

    def close(self):
        self.flush()
        self._file.close()
