"""The audio hot paths as viper code: machine code on the ESP32 and the unix port, and the same
source on CPython through compat_cpython's shim. A port without the native emitter (the
WebAssembly port) cannot compile this module; audio.py then uses its portable loops.

Samples are PCM16 little-endian (every port here is little-endian, like the I2S data).
"""

try:
    import micropython
except ImportError:  # CPython (simulator, host tests): the shim runs this very code
    from compat_cpython import micropython, ptr16, ptr32  # noqa: F401


@micropython.viper
def scale_pcm16(buf: ptr16, samples: int, gain: int):
    """Multiply each signed sample by gain / 256 in place (gain 0..256: never clips)."""
    i = 0
    while i < samples:
        sample = (buf[i] ^ 0x8000) - 0x8000  # unsigned 16-bit load -> signed
        buf[i] = ((sample * gain) >> 8) & 0xFFFF
        i += 1


@micropython.viper
def pcm32_to_pcm16(src: ptr32, dst: ptr16, samples: int):
    """Keep the top 16 bits of each 32-bit slot (INMP441-style microphones: 24 bits in 32)."""
    i = 0
    while i < samples:
        dst[i] = (src[i] >> 16) & 0xFFFF
        i += 1
