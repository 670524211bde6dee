# Host-only fallbacks for compat.py. Never deployed to a board; excluded from
# the MicroPython type check.
import time

_TICKS_PERIOD = 0x40000000
_TICKS_HALF = _TICKS_PERIOD // 2


def const(value):
    return value


def ticks_ms():
    return int(time.monotonic() * 1000) & (_TICKS_PERIOD - 1)


def ticks_diff(end, start):
    return ((end - start + _TICKS_HALF) & (_TICKS_PERIOD - 1)) - _TICKS_HALF


def sleep_ms(ms):
    time.sleep(ms / 1000)


def mask(data, key):
    """Return a bytearray of data XOR-ed with the 4-byte WebSocket mask key.

    One big-integer XOR instead of a per-byte loop: about 100x faster on CPython.
    """
    n = len(data)
    if not n:
        return bytearray()
    repeated = (bytes(key) * (n // 4 + 1))[:n]
    value = int.from_bytes(data, "big") ^ int.from_bytes(repeated, "big")
    return bytearray(value.to_bytes(n, "big"))


def aes_ctr(key, counter, data):
    """AES-128-CTR of data with the 16-byte initial counter block (encrypts and decrypts)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    cipher = Cipher(algorithms.AES(bytes(key)), modes.CTR(bytes(counter))).encryptor()
    return cipher.update(bytes(data)) + cipher.finalize()


def _alias_micropython_modules():
    """micropython-lib's umqtt.simple 1.3.4 imports usocket, ustruct and ubinascii; CPython has
    the same modules without the `u` (its sockets are never used: transport_mqtt does the I/O)."""
    import binascii
    import socket
    import struct
    import sys

    for name, module in (("usocket", socket), ("ustruct", struct), ("ubinascii", binascii)):
        sys.modules.setdefault(name, module)


_alias_micropython_modules()


# ---- @micropython.viper / @micropython.native on CPython ---------------------------------------
# The viper kernels (audio_native.py) run unchanged here: a pointer-typed argument becomes a
# memoryview of the buffer with the pointer's item size, which indexes like the pointer does.


class _Pointer:
    """A viper pointer type as an annotation; the shim passes a memoryview in its place."""

    typecode = "B"

    def __getitem__(self, index: int) -> int:
        raise TypeError("a viper pointer type is only an annotation")

    def __setitem__(self, index: int, value: int) -> None:
        raise TypeError("a viper pointer type is only an annotation")


class ptr8(_Pointer):  # noqa: N801  (the viper type names)
    typecode = "B"


class ptr16(_Pointer):  # noqa: N801
    typecode = "H"


class ptr32(_Pointer):  # noqa: N801
    typecode = "I"


def _viper(function):
    annotations = getattr(function, "__annotations__", {})
    names = function.__code__.co_varnames[: function.__code__.co_argcount]
    casts = [getattr(annotations.get(name), "typecode", None) for name in names]

    def call(*args):
        views = [
            memoryview(arg).cast(code) if code is not None else arg
            for arg, code in zip(args, casts)
        ]
        return function(*views)

    call.__name__ = function.__name__
    return call


class _MicroPythonShim:
    """The decorators of the `micropython` module, for code shared with the device."""

    viper = staticmethod(_viper)
    native = staticmethod(lambda function: function)


micropython = _MicroPythonShim()
