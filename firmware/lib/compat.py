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

except ImportError:  # CPython: simulator and host tests
    from compat_cpython import const, mask, sleep_ms, ticks_diff, ticks_ms  # noqa: F401
