"""The UDP audio channel of an MQTT conversation, as the stock firmware runs it (reference §2.3).

The server hello's `udp` block gives the address, a 16-byte AES key and a 16-byte nonce. Every
datagram is a 16-byte header and the AES-128-CTR ciphertext of one audio packet, the header
being the initial counter block. Uplink header = the nonce with bytes 2-3 (payload length), 8-11
(timestamp, 0) and 12-15 (sequence, from 1) overwritten; bytes 0-1 and 4-7 are the nonce's.
Downlink: dropped unless at least 16 bytes, type byte 0x01, length == 16 + payload_len and
sequence above the last accepted one (counted in `drops`).

Same code on the ESP32, the unix port and CPython; nothing here blocks (the socket is
non-blocking and polled every `POLL_MS` while a conversation is open).
"""

import asyncio
from binascii import unhexlify

from compat import aes_ctr, const

POLL_MS = const(10)
HEADER = const(16)
MAX_DATAGRAM = const(1600)


def parse_block(block):
    """(server, port, key, nonce) of a hello's `udp` object; ValueError if the stock firmware
    would reject it (missing fields, a port out of range, key or nonce not 16 bytes)."""
    if not isinstance(block, dict):
        raise ValueError("hello has no udp object")
    server, port = block.get("server"), block.get("port")
    key, nonce = block.get("key"), block.get("nonce")
    if not isinstance(server, str) or not server:
        raise ValueError("udp.server must be a string")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError("udp.port must be 1..65535")
    if not isinstance(key, str) or not isinstance(nonce, str) or len(key) != 32 or len(nonce) != 32:
        raise ValueError("udp.key and udp.nonce must be 32 hex digits")
    return server, port, unhexlify(key), unhexlify(nonce)


def uplink_header(nonce, payload_len, timestamp, sequence) -> bytes:
    return (
        nonce[0:2]
        + (payload_len & 0xFFFF).to_bytes(2, "big")
        + nonce[4:8]
        + (timestamp & 0xFFFFFFFF).to_bytes(4, "big")
        + (sequence & 0xFFFFFFFF).to_bytes(4, "big")
    )


class UdpAudio:
    """One conversation's audio socket: `send(payload)`, downlink to `on_audio(payload)`."""

    def __init__(self, block, on_audio, log=print):
        self.server, self.port, self.key, self.nonce = parse_block(block)
        self.on_audio = on_audio
        self.log = log
        self.sent = 0
        self.received = 0
        self.drops = 0
        self._uplink_seq = 0
        self._downlink_seq = 0
        self._sock = None
        self._task = None

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def open(self):
        import socket  # here: the WebAssembly port (firmware unit tests) has no socket module

        address = socket.getaddrinfo(self.server, self.port, 0, socket.SOCK_DGRAM)[0][-1]
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.connect(address)
        sock.setblocking(False)
        self._sock = sock
        self._task = asyncio.create_task(self._receive())

    def close(self):
        sock, self._sock = self._sock, None
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if sock is not None:
            sock.close()

    def send(self, payload, timestamp=0) -> bool:
        """Encrypt and send one audio packet; False when the channel is closed or send fails."""
        sock = self._sock
        if sock is None:
            return False
        self._uplink_seq += 1
        header = uplink_header(self.nonce, len(payload), timestamp, self._uplink_seq)
        try:
            sock.send(header + aes_ctr(self.key, header, payload))
        except OSError as error:
            self.log("udp: send failed: " + str(error))
            return False
        self.sent += 1
        return True

    def accept(self, datagram):
        """The decrypted payload of a valid downlink datagram, else None (counted as a drop)."""
        size = len(datagram)
        if size < HEADER or datagram[0] != 1:
            self.drops += 1
            return None
        payload_len = (datagram[2] << 8) | datagram[3]
        sequence = int.from_bytes(datagram[12:16], "big")
        if size != HEADER + payload_len or sequence <= self._downlink_seq:
            self.drops += 1
            return None
        self._downlink_seq = sequence
        self.received += 1
        return aes_ctr(self.key, datagram[:HEADER], datagram[HEADER:])

    async def _receive(self):
        while self._sock is not None:
            try:
                datagram = self._sock.recv(MAX_DATAGRAM)
            except OSError:  # EAGAIN: nothing waiting (or an ICMP error for an earlier send)
                await asyncio.sleep(POLL_MS / 1000)
                continue
            payload = self.accept(datagram)
            if payload is not None:
                try:
                    self.on_audio(payload)
                except Exception as error:  # the sink's bug must not stop the channel
                    self.log("udp: audio sink failed: " + str(error))
