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
