"""The device's side of UDP audio, written from the protocol reference (not from
`backend.transports.udp`): the header from the hello's nonce exactly as the firmware builds it
(bytes 2-3, 8-11, 12-15 overwritten), encrypted with `cryptography` directly."""

import asyncio
import socket
import struct

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

HEADER_SIZE = 16

OPUS_60MS = bytes([11 << 3]) + bytes(40)  # TOC: SILK wideband 60 ms, mono, one frame (code 0)


def device_header(nonce: bytes, payload_len: int, timestamp: int, sequence: int) -> bytes:
    header = bytearray(nonce)
    header[2:4] = struct.pack(">H", payload_len)
    header[8:12] = struct.pack(">I", timestamp)
    header[12:16] = struct.pack(">I", sequence)
    return bytes(header)


def device_packet(key: bytes, nonce: bytes, payload: bytes, sequence: int, ts: int = 0) -> bytes:
    header = device_header(nonce, len(payload), ts, sequence)
    encryptor = Cipher(algorithms.AES(key), modes.CTR(header)).encryptor()
    return header + encryptor.update(payload) + encryptor.finalize()


def device_open(key: bytes, datagram: bytes) -> tuple[int, int, bytes]:
    """What firmware ≥2.4 accepts: type 0x01 and exact length; returns (sequence, ts, payload)."""
    assert datagram[0] == 0x01
    (payload_len,) = struct.unpack_from(">H", datagram, 2)
    assert len(datagram) == HEADER_SIZE + payload_len
    timestamp, sequence = struct.unpack_from(">II", datagram, 8)
    decryptor = Cipher(algorithms.AES(key), modes.CTR(datagram[:16])).decryptor()
    return sequence, timestamp, decryptor.update(datagram[16:]) + decryptor.finalize()


class DeviceSocket:
    """A device's UDP socket bound to `host` (another loopback address plays another host),
    "connected" to the server as the firmware's is."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.connect(("127.0.0.1", port))
        self.sock.setblocking(False)
        self.address: tuple[str, int] = self.sock.getsockname()

    def send(self, datagram: bytes) -> None:
        self.sock.send(datagram)

    async def recv(self, timeout_s: float = 5.0) -> bytes:
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.sock_recv(self.sock, 65536), timeout_s)

    def pending(self) -> bool:
        try:
            self.sock.recv(65536, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()
