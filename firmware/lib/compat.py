# The only firmware module that branches on the runtime (MicroPython on the
# device and on the unix port, CPython in the simulator and the tests).
import sys

MICROPYTHON = sys.implementation.name == "micropython"
NATIVE_MASK = False  # True where mask() runs as viper machine code

# Kept as text and compiled at import: a port without the native emitter (the WebAssembly port
# used in CI) rejects @micropython.viper at compile time, which would make this whole module
# unimportable. There the portable loop below stays in place.
_VIPER_XOR = """
@micropython.viper
def _xor_in_place(buf: ptr8, n: int, key: ptr8):
    i = 0
    while i < n:
        buf[i] = buf[i] ^ key[i & 3]
        i += 1
"""

try:
    from time import sleep_ms, ticks_diff, ticks_ms

    import micropython  # noqa: F401  (used by the _VIPER_XOR source)
    from micropython import const

    def _xor_in_place(buf, n, key):
        for i in range(n):
            buf[i] ^= key[i & 3]

    try:
        exec(_VIPER_XOR, globals())
        NATIVE_MASK = True
    except SyntaxError:
        pass

    def mask(data, key):
        """Return a bytearray of data XOR-ed with the 4-byte WebSocket mask key."""
        out = bytearray(data)
        _xor_in_place(out, len(out), key)
        return out

    def aes_ctr(key, counter, data):
        """AES-128-CTR of data with the 16-byte initial counter block (encrypts and decrypts)."""
        from cryptolib import aes

        try:
            return aes(key, 6, counter).encrypt(data)  # ports built with CTR mode
        except ValueError:  # no CTR here (e.g. the unix port): ECB over the counter blocks
            pass
        ecb = aes(key, 1)
        start = int.from_bytes(counter, "big")
        out = bytearray(data)
        for offset in range(0, len(out), 16):
            stream = ecb.encrypt(((start + offset // 16) & _U128).to_bytes(16, "big"))
            for i in range(min(16, len(out) - offset)):
                out[offset + i] ^= stream[i]
        return bytes(out)

    _U128 = (1 << 128) - 1

except ImportError:  # CPython: simulator and host tests
    from compat_cpython import aes_ctr, const, mask, sleep_ms, ticks_diff, ticks_ms  # noqa: F401
