"""The device side of `bench.udp`, in its own process: `python -m bench.udp_peer ROLE CONFIG`.

CONFIG is a JSON file: `server` [host, port], `sessions` [{"key": hex, "nonce": hex}] (a count
for `receiver`), and the role's own fields. Each session sends from a UDP socket of its own
("connected", as on a device), with headers and AES-128-CTR built here the firmware's way.
The role prints one JSON line with what it did and exits.

- `blast`: `count` datagrams per session, round-robin, as fast as possible.
- `streams`: one datagram per session every `interval_ms` for `seconds`, staggered; counts the
  downlink datagrams that come back and checks their sequence numbers.
- `impaired`: like `streams`, but each uplink datagram is lost with `loss`, duplicated with
  `duplicate`, and delayed by a normal(`delay_ms`, `jitter_ms`) draw (so some overtake others).
- `flood`: an attacker who knows every session's cookie but no key: from sockets bound to the
  addresses in `bind`, forged datagrams (random ciphertext, sequences ahead of the devices') as
  fast as it can for `seconds`.
- `receiver`: a `UdpAudioChannel` on `server` with `sessions` sessions; prints their keys and
  nonces, runs until stdin closes, then prints its counters and what was delivered (the netem
  run puts it in a network namespace of its own; the flood run measures its RSS).
"""

import asyncio
import json
import random
import resource
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Sender:
    def __init__(self, server: tuple[str, int], key: bytes, nonce: bytes, size: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.connect(server)
        self.sock.setblocking(False)
        self.aes = algorithms.AES(key)
        self.nonce = nonce
        self.payload = bytes(size)
        self.sequence = 0
        self.key = key
        self.downlink = 0
        self.downlink_out_of_order = 0
        self.last_downlink = 0

    def packet(self) -> bytes:
        """The next uplink datagram; its payload starts with the sequence (for order checks)."""
        self.sequence += 1
        payload = struct.pack(">I", self.sequence) + self.payload[4:]
        header = bytearray(self.nonce)
        header[2:4] = struct.pack(">H", len(payload))
        header[8:16] = struct.pack(">II", 0, self.sequence)
        encryptor = Cipher(self.aes, modes.CTR(bytes(header))).encryptor()
        return bytes(header) + encryptor.update(payload)

    def send(self, datagram: bytes) -> bool:
        try:
            self.sock.send(datagram)
        except (BlockingIOError, ConnectionRefusedError):
            return False
        return True

    def drain(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, ConnectionRefusedError):
                return
            if len(data) >= 16:
                (sequence,) = struct.unpack_from(">I", data, 12)
                self.downlink += 1
                if sequence <= self.last_downlink:
                    self.downlink_out_of_order += 1
                self.last_downlink = max(self.last_downlink, sequence)


def _senders(config: dict[str, Any]) -> list[Sender]:
    server = (config["server"][0], int(config["server"][1]))
    return [
        Sender(server, bytes.fromhex(s["key"]), bytes.fromhex(s["nonce"]), config["payload"])
        for s in config["sessions"]
    ]


async def blast(config: dict[str, Any]) -> dict[str, Any]:
    senders = _senders(config)
    began, cpu = time.monotonic(), _cpu_s()
    sent = 0
    for index in range(config["count"]):
        for sender in senders:
            sent += sender.send(sender.packet())
        if index % 8 == 7:
            await asyncio.sleep(0)
    return {
        "sent": sent,
        "wall_s": time.monotonic() - began,
        "cpu_s": _cpu_s() - cpu,
    }


async def streams(config: dict[str, Any], impaired: bool = False) -> dict[str, Any]:
    senders = _senders(config)
    loop = asyncio.get_running_loop()
    rng = random.Random(config.get("seed", 1))
    interval = config["interval_ms"] / 1000
    deadline = loop.time() + config["seconds"]
    sent = lost = duplicated = 0

    def schedule(sender: Sender, datagram: bytes) -> None:
        delay = max(0.0, rng.gauss(config["delay_ms"], config["jitter_ms"]) / 1000)
        loop.call_later(delay, sender.send, datagram)

    async def stream(index: int, sender: Sender) -> None:
        nonlocal sent, lost, duplicated
        await asyncio.sleep(interval * index / len(senders))
        next_at = loop.time()
        while next_at < deadline:
            datagram = sender.packet()
            sent += 1
            if not impaired:
                sender.send(datagram)
            elif rng.random() < config["loss"]:
                lost += 1
            else:
                schedule(sender, datagram)
                if rng.random() < config["duplicate"]:
                    duplicated += 1
                    schedule(sender, datagram)
            sender.drain()
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    cpu = _cpu_s()
    await asyncio.gather(*(stream(i, s) for i, s in enumerate(senders)))
    await asyncio.sleep(config.get("delay_ms", 0) / 1000 + 0.5)  # let delayed datagrams land
    for sender in senders:
        sender.drain()
    return {
        "sent": sent,
        "lost_on_purpose": lost,
        "duplicated_on_purpose": duplicated,
        "downlink": sum(s.downlink for s in senders),
        "downlink_out_of_order": sum(s.downlink_out_of_order for s in senders),
        "cpu_s": _cpu_s() - cpu,
    }


async def flood(config: dict[str, Any]) -> dict[str, Any]:
    server = (config["server"][0], int(config["server"][1]))
    cookies = [bytes.fromhex(s["nonce"])[:8] for s in config["sessions"]]
    sockets = []
    for host in config["bind"]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((host, 0))
        sock.connect(server)
        sock.setblocking(False)
        sockets.append(sock)
    rng = random.Random(config.get("seed", 16))
    bodies = [rng.randbytes(config["payload"]) for _ in range(64)]
    length = struct.pack(">H", config["payload"])
    loop = asyncio.get_running_loop()
    deadline = loop.time() + config["seconds"]
    sent = refused = 0
    sequence = 40_000  # ahead of every device: charged to a device, it would block its uplink
    while loop.time() < deadline:
        for _ in range(64):
            sequence += 1
            cookie = cookies[sequence % len(cookies)]
            header = cookie[0:2] + length + cookie[4:8] + struct.pack(">II", 0, sequence)
            try:
                sockets[sequence % len(sockets)].send(header + bodies[sequence % 64])
                sent += 1
            except (BlockingIOError, ConnectionRefusedError):
                refused += 1
        await asyncio.sleep(0)
    for sock in sockets:
        sock.close()
    return {"sent": sent, "refused": refused}


async def receiver(config: dict[str, Any]) -> dict[str, Any]:
    from backend.protocol.audio import AudioFrame
    from backend.transports.udp import UdpAudioChannel
    from bench.common import quiet_logging

    quiet_logging()  # warnings only: log I/O would distort the figures

    channel = UdpAudioChannel(config["server"][0], int(config["server"][1]))
    await channel.start()
    counts = [0] * config["sessions"]
    out_of_order = foreign = 0
    specs = []
    for index in range(config["sessions"]):
        last = [0]

        def sink(frame: AudioFrame, slot: int = index, last: list[int] = last) -> None:
            nonlocal out_of_order, foreign
            counts[slot] += 1
            (sequence,) = struct.unpack_from(">I", frame.payload, 0)
            foreign += sequence > 1 << 20  # devices' payloads start with their small sequence
            out_of_order += sequence <= last[0]
            last[0] = sequence

        session = channel.open_session(f"bench-{index}", "s", sink)
        specs.append({"key": session.key.hex(), "nonce": session.nonce.hex()})
    print(json.dumps({"ready": True, "port": channel.port, "sessions": specs}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await channel.stop()
    return {
        "delivered": sum(counts),
        "delivered_out_of_order": out_of_order,
        "foreign": foreign,
        "counters": channel.stats(),
    }


def main() -> None:
    role, path = sys.argv[1], sys.argv[2]
    config = json.loads(Path(path).read_text())
    runners = {
        "blast": lambda: blast(config),
        "streams": lambda: streams(config),
        "impaired": lambda: streams(config, impaired=True),
        "flood": lambda: flood(config),
        "receiver": lambda: receiver(config),
    }
    print(json.dumps(asyncio.run(runners[role]())), flush=True)


if __name__ == "__main__":
    main()
