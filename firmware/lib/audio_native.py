"""The audio hot paths as viper code: machine code on the ESP32 and the unix port, and the same
source on CPython through compat_cpython's shim (a pointer argument becomes a memoryview).

Kept as text and compiled at import, like compat's mask: mpy-cross without -march (the release
bundle, the tests) rejects viper, and so does a port without the native emitter (the WebAssembly
port), where importing this module raises SyntaxError and audio.py uses its portable loops.
Samples are PCM16 little-endian (every port here is little-endian, like the I2S data).
"""

_VIPER_SOURCE = """
@micropython.viper
def scale_pcm16(buf: ptr16, samples: int, gain: int):
    # Multiply each signed sample by gain / 256 in place (gain 0..256: never clips).
    i = 0
    while i < samples:
        sample = (buf[i] ^ 0x8000) - 0x8000  # unsigned 16-bit load -> signed
        buf[i] = ((sample * gain) >> 8) & 0xFFFF
        i += 1


@micropython.viper
def pcm32_to_pcm16(src: ptr32, dst: ptr16, samples: int):
    # Keep the top 16 bits of each 32-bit slot (INMP441-style microphones: 24 bits in 32).
    i = 0
    while i < samples:
        dst[i] = (src[i] >> 16) & 0xFFFF
        i += 1
"""

try:
    import micropython

    _NAMES: dict = {"micropython": micropython}
except ImportError:  # CPython (simulator, host tests): the shim runs this very code
    import compat_cpython

    _NAMES: dict = {
        "micropython": compat_cpython.micropython,
        "ptr16": compat_cpython.ptr16,
        "ptr32": compat_cpython.ptr32,
    }

exec(_VIPER_SOURCE, _NAMES)
scale_pcm16 = _NAMES["scale_pcm16"]
pcm32_to_pcm16 = _NAMES["pcm32_to_pcm16"]
