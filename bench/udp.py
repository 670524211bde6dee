"""Benchmark: the UDP audio channel of the MQTT transport (`backend.transports.udp`).

1. Datagrams decrypted and routed per CPU second, in process (`handle_datagram` on prepared
   datagrams of 100 sessions) and over loopback sockets (a device process sends from 100
   sockets as fast as it can; CPU of this process per delivered datagram). Same-run baselines:
   the header parse alone and one AES-CTR decryption alone; a bare asyncio endpoint that only
   counts datagrams.
2. The share of one core that 100 concurrent 60 ms audio streams cost: 100 device sockets each
   send one datagram every 60 ms for the whole run, and (second row) this process sends each
   session one downlink datagram every 60 ms too. CPU seconds of this process / wall seconds.
3. A bad network: 5 % loss, 40 ms ± 20 ms delay (reordering), 1 % duplicates. With `tc netem`
   on a veth pair between two network namespaces when the kernel offers netem; on loopback with
   the same impairment applied in the sending process otherwise (labelled as such). Frames
   delivered, dropped by the sequence rule (late or duplicated), and no crash.
4. A flood with known cookies from another address (127.0.0.2): the channel in a process of its
   own, 20 devices streaming, an attacker process sending forged datagrams with their cookies
   as fast as it can. The devices' delivered-frame ratio and the channel process's RSS growth,
   against the same run without the attacker (interleaved, same machine state).

Payloads are 160 bytes: a 60 ms, 16 kHz Opus frame at about 21 kbit/s.
"""

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from backend.protocol.audio import AudioFrame
from backend.transports.udp import (
    UdpAudioChannel,
    UdpSession,
)
from backend.transports.udp_packet import (
    CtrKeystream,
    ctr_xor,
    parse_header,
    seal,
)
from bench.common import REPO, bench_main, quiet_logging, table, verdict
from bench.report import environment

NAME = "udp"
PAYLOAD = 160
STREAMS = 100
INTERVAL_MS = 60
TARGET_SHARE = 0.10  # design budget: 100 streams, both directions, within 10 % of one core
NS_A, NS_B, VETH_A, VETH_B = "udpb-a", "udpb-b", "udpb-va", "udpb-vb"
ADDR_A, ADDR_B = "10.213.7.1", "10.213.7.2"


# ---- 1. throughput ------------------------------------------------------------------------------


def in_process(count: int) -> list[list[Any]]:
    channel = UdpAudioChannel("127.0.0.1", 0)
    sessions = [channel.open_session(f"d{i}", "s", lambda _f: None) for i in range(STREAMS)]
    per = count // STREAMS
    datagrams = [
        seal(s.key, s.nonce, bytes(PAYLOAD), 0, sequence)
        for sequence in range(1, per + 1)
        for s in sessions
    ]
    source = ("127.0.0.1", 40000)
    key, header = sessions[0].key, datagrams[0][:16]

    def timed(step: Any) -> float:
        began = time.process_time()
        for datagram in datagrams:
            step(datagram)
        return (time.process_time() - began) / len(datagrams)

    keystream = CtrKeystream(key)
    parse = timed(parse_header)
    decrypt = timed(lambda d: ctr_xor(key, header, d[16:]))
    fast = timed(lambda d: keystream.xor(header, d[16:]))
    full = timed(lambda d: channel.handle_datagram(d, source))
    assert channel.counters["rx_audio"] == len(datagrams), channel.counters

    def row(name: str, seconds: float) -> list[Any]:
        return [name, f"{seconds * 1e6:.2f}", f"{1 / seconds:,.0f}"]

    return [
        row("header parse only (baseline)", parse),
        row("AES-CTR with a new `modes.CTR` context per datagram (baseline)", decrypt),
        row("AES-CTR with a reused ECB context (`CtrKeystream`, what sessions use)", fast),
        row("`handle_datagram`: checks, route, decrypt, deliver", full),
    ]


class _Counter(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.count = 0

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.count += 1


@contextlib.asynccontextmanager
async def _config(**values: Any) -> AsyncIterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench-udp-") as scratch:
        path = Path(scratch) / "config.json"
        path.write_text(json.dumps(values))
        yield path


async def _peer(role: str, config: Path, prefix: list[str] | None = None) -> dict[str, Any]:
    argv = [*(prefix or []), sys.executable, "-m", "bench.udp_peer", role, str(config)]
    process = await asyncio.create_subprocess_exec(
        *argv, cwd=REPO, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL
    )
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"udp peer {role} exited with {process.returncode}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def _specs(sessions: list[UdpSession]) -> list[dict[str, str]]:
    return [{"key": s.key.hex(), "nonce": s.nonce.hex()} for s in sessions]


async def _settle(read: Any, quiet_s: float = 0.3) -> None:
    """Until `read()` has not changed for `quiet_s`."""
    last, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        await asyncio.sleep(0.05)
        if read() != last:
            last, since = read(), time.monotonic()


async def blast_ours(per_session: int) -> tuple[int, int, float]:
    channel = UdpAudioChannel("127.0.0.1", 0)
    await channel.start()
    sessions = [channel.open_session(f"d{i}", "s", lambda _f: None) for i in range(STREAMS)]
    try:
        async with _config(
            server=["127.0.0.1", channel.port],
            sessions=_specs(sessions),
            payload=PAYLOAD,
            count=per_session,
        ) as config:
            cpu = time.process_time()
            sent = (await _peer("blast", config))["sent"]
            await _settle(lambda: channel.counters.get("rx_datagrams", 0))
            used = time.process_time() - cpu
        return sent, channel.counters.get("rx_audio", 0), used
    finally:
        await channel.stop()


async def blast_bare(per_session: int) -> tuple[int, int, float]:
    loop = asyncio.get_running_loop()
    counter = _Counter()
    transport, _ = await loop.create_datagram_endpoint(lambda: counter, local_addr=("127.0.0.1", 0))
    port = transport.get_extra_info("sockname")[1]
    scratch = UdpAudioChannel("127.0.0.1", 0)
    sessions = [scratch.open_session(f"d{i}", "s", lambda _f: None) for i in range(STREAMS)]
    try:
        async with _config(
            server=["127.0.0.1", port],
            sessions=_specs(sessions),
            payload=PAYLOAD,
            count=per_session,
        ) as config:
            cpu = time.process_time()
            sent = (await _peer("blast", config))["sent"]
            await _settle(lambda: counter.count)
            used = time.process_time() - cpu
        return sent, counter.count, used
    finally:
        transport.close()


# ---- 2. 100 real-time streams -------------------------------------------------------------------


async def streams_share(seconds: float, downlink: bool) -> dict[str, Any]:
    channel = UdpAudioChannel("127.0.0.1", 0)
    await channel.start()
    sessions = [channel.open_session(f"d{i}", "s", lambda _f: None) for i in range(STREAMS)]
    sent_down = 0

    async def speak() -> None:
        nonlocal sent_down
        frame = AudioFrame(bytes(PAYLOAD), 0)
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            for session in sessions:
                if session.peer is not None:
                    sent_down += channel.send(session, frame)
            next_at += INTERVAL_MS / 1000
            await asyncio.sleep(max(0.0, next_at - loop.time()))

    speaker = asyncio.create_task(speak()) if downlink else None
    try:
        async with _config(
            server=["127.0.0.1", channel.port],
            sessions=_specs(sessions),
            payload=PAYLOAD,
            interval_ms=INTERVAL_MS,
            seconds=seconds,
        ) as config:
            wall, cpu = time.monotonic(), time.process_time()
            peer = await _peer("streams", config)
            used, elapsed = time.process_time() - cpu, time.monotonic() - wall
    finally:
        if speaker is not None:
            speaker.cancel()
            await asyncio.gather(speaker, return_exceptions=True)
        await channel.stop()
    return {
        "share": used / elapsed,
        "cpu_s": used,
        "uplink": channel.counters.get("rx_audio", 0),
        "sent_up": peer["sent"],
        "downlink_sent": sent_down,
        "downlink_received": peer["downlink"],
        "downlink_out_of_order": peer["downlink_out_of_order"],
    }


async def streams_share_bare(seconds: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    counter = _Counter()
    transport, _ = await loop.create_datagram_endpoint(lambda: counter, local_addr=("127.0.0.1", 0))
    scratch = UdpAudioChannel("127.0.0.1", 0)
    sessions = [scratch.open_session(f"d{i}", "s", lambda _f: None) for i in range(STREAMS)]
    try:
        async with _config(
            server=["127.0.0.1", transport.get_extra_info("sockname")[1]],
            sessions=_specs(sessions),
            payload=PAYLOAD,
            interval_ms=INTERVAL_MS,
            seconds=seconds,
        ) as config:
            wall, cpu = time.monotonic(), time.process_time()
            await _peer("streams", config)
            used, elapsed = time.process_time() - cpu, time.monotonic() - wall
    finally:
        transport.close()
    return {"share": used / elapsed, "cpu_s": used, "uplink": counter.count}


# ---- 3. bad network ------------------------------------------------------------------------------

IMPAIRMENT = {"loss": 0.05, "delay_ms": 40, "jitter_ms": 20, "duplicate": 0.01}


class _OrderedSink:
    """Counts frames per session and any that arrive with a sequence not above the last."""

    def __init__(self) -> None:
        self.delivered = 0
        self.out_of_order = 0
        self.last: dict[int, int] = {}

    def for_session(self, slot: int) -> Any:
        def sink(frame: AudioFrame) -> None:
            sequence = int.from_bytes(frame.payload[:4], "big")
            self.delivered += 1
            self.out_of_order += sequence <= self.last.get(slot, 0)
            self.last[slot] = sequence

        return sink


async def impaired_loopback(seconds: float) -> dict[str, Any]:
    channel = UdpAudioChannel("127.0.0.1", 0)
    await channel.start()
    sink = _OrderedSink()
    sessions = [channel.open_session(f"d{i}", "s", sink.for_session(i)) for i in range(STREAMS)]
    try:
        async with _config(
            server=["127.0.0.1", channel.port],
            sessions=_specs(sessions),
            payload=PAYLOAD,
            interval_ms=INTERVAL_MS,
            seconds=seconds,
            seed=7,
            **IMPAIRMENT,
        ) as config:
            peer = await _peer("impaired", config)
        await _settle(lambda: channel.counters.get("rx_datagrams", 0))
    finally:
        await channel.stop()
    return {
        **peer,
        "delivered": sink.delivered,
        "delivered_out_of_order": sink.out_of_order,
        "dropped_by_sequence": channel.counters.get("drop_replay", 0),
        "received": channel.counters.get("rx_datagrams", 0),
    }


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def netem_setup() -> str | None:
    """Two namespaces joined by a veth pair, netem on both ends; None if done, else why not."""
    netem = (
        f"netem loss {IMPAIRMENT['loss'] * 100:g}% delay {IMPAIRMENT['delay_ms']}ms "
        f"{IMPAIRMENT['jitter_ms']}ms duplicate {IMPAIRMENT['duplicate'] * 100:g}%"
    ).split()
    steps = [
        ["ip", "netns", "add", NS_A],
        ["ip", "netns", "add", NS_B],
        ["ip", "link", "add", VETH_A, "type", "veth", "peer", "name", VETH_B],
        ["ip", "link", "set", VETH_A, "netns", NS_A],
        ["ip", "link", "set", VETH_B, "netns", NS_B],
        ["ip", "-n", NS_A, "addr", "add", f"{ADDR_A}/24", "dev", VETH_A],
        ["ip", "-n", NS_B, "addr", "add", f"{ADDR_B}/24", "dev", VETH_B],
        ["ip", "-n", NS_A, "link", "set", VETH_A, "up"],
        ["ip", "-n", NS_B, "link", "set", VETH_B, "up"],
        ["ip", "netns", "exec", NS_A, "tc", "qdisc", "add", "dev", VETH_A, "root", *netem],
        ["ip", "netns", "exec", NS_B, "tc", "qdisc", "add", "dev", VETH_B, "root", *netem],
    ]
    try:
        for step in steps:
            _run(*step)
    except FileNotFoundError as exc:
        netem_teardown()
        return f"`{exc.filename}` not available"
    except subprocess.CalledProcessError as exc:
        netem_teardown()
        lines = (exc.stderr or b"").decode().strip().splitlines()
        reason = lines[-1].rstrip(".") if lines else f"exit code {exc.returncode}"
        return f"`{' '.join(exc.cmd[:6])} …` failed ({reason})"
    return None


def netem_teardown() -> None:
    for namespace in (NS_A, NS_B):  # deleting a namespace deletes its end of the veth pair
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


async def impaired_netem(seconds: float) -> dict[str, Any]:
    prefix = ["ip", "netns", "exec", NS_A]
    async with _config(server=[ADDR_A, 0], sessions=STREAMS) as receiver_config:
        receiver = await asyncio.create_subprocess_exec(
            *prefix,
            sys.executable,
            "-m",
            "bench.udp_peer",
            "receiver",
            str(receiver_config),
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert receiver.stdout is not None and receiver.stdin is not None
        ready = json.loads(await asyncio.wait_for(receiver.stdout.readline(), 30))
        async with _config(
            server=[ADDR_A, ready["port"]],
            sessions=ready["sessions"],
            payload=PAYLOAD,
            interval_ms=INTERVAL_MS,
            seconds=seconds,
            delay_ms=0,
        ) as sender_config:
            peer = await _peer("streams", sender_config, ["ip", "netns", "exec", NS_B])
        receiver.stdin.close()
        result = json.loads((await receiver.stdout.read()).decode().strip().splitlines()[-1])
        code = await receiver.wait()
    counters = result["counters"]
    return {
        "sent": peer["sent"],
        "received": counters.get("rx_datagrams", 0),
        "delivered": result["delivered"],
        "delivered_out_of_order": result["delivered_out_of_order"],
        "dropped_by_sequence": counters.get("drop_replay", 0),
        "receiver_exit": code,
    }


# ---- 4. flood with known cookies ----------------------------------------------------------------

FLOOD_DEVICES = 20
FLOOD_FROM = "127.0.0.2"


async def flood_run(seconds: float, attack: bool) -> dict[str, Any]:
    """Devices stream to a receiver process for `seconds`, with or without the attacker."""
    import psutil

    async with _config(server=["127.0.0.1", 0], sessions=FLOOD_DEVICES) as receiver_config:
        receiver = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "bench.udp_peer", "receiver", str(receiver_config)),
            cwd=REPO,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert receiver.stdout is not None and receiver.stdin is not None
        ready = await _ready(receiver.stdout)
        memory = psutil.Process(receiver.pid)
        overflows = _rcvbuf_errors()
        rss_before = memory.memory_info().rss
        server = ["127.0.0.1", ready["port"]]
        common = {"server": server, "sessions": ready["sessions"], "payload": PAYLOAD}
        async with (
            _config(**common, interval_ms=INTERVAL_MS, seconds=seconds) as devices,
            _config(**common, bind=[FLOOD_FROM], seconds=seconds) as attacker,
        ):
            runs = [_peer("streams", devices)] + ([_peer("flood", attacker)] if attack else [])
            peers = await asyncio.gather(*runs)
        await asyncio.sleep(0.5)  # let the receiver drain its socket
        rss_after = memory.memory_info().rss
        overflows = _rcvbuf_errors() - overflows
        receiver.stdin.close()
        result = json.loads((await receiver.stdout.read()).decode().strip().splitlines()[-1])
        await receiver.wait()
    return {
        "sent": peers[0]["sent"],
        "delivered": result["delivered"],
        "foreign": result["foreign"],
        "flood_sent": peers[1]["sent"] if attack else 0,
        "counters": result["counters"],
        "rss_growth": rss_after - rss_before,
        "rcvbuf_errors": overflows,
    }


async def _ready(stdout: asyncio.StreamReader) -> dict[str, Any]:
    """The receiver's ready line (log lines may come first)."""
    while True:
        line = (await asyncio.wait_for(stdout.readline(), 30)).decode()
        if not line:
            raise RuntimeError("udp receiver exited before it was ready")
        if line.startswith('{"ready"'):
            ready: dict[str, Any] = json.loads(line)
            return ready


def _rcvbuf_errors() -> int:
    """The kernel's count of UDP datagrams dropped for a full receive buffer (-1 if unknown)."""
    try:
        lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines()]
    except OSError:
        return -1
    names, values = [line for line in lines if line and line[0] == "Udp:"][:2]
    return int(values[names.index("RcvbufErrors")])


def _flood_rows(base: dict[str, Any], flood: dict[str, Any]) -> list[list[Any]]:
    def row(name: str, run: dict[str, Any]) -> list[Any]:
        counters = run["counters"]
        return [
            name,
            f"{run['flood_sent']:,}",
            f"{run['delivered']:,} / {run['sent']:,} ({run['delivered'] / run['sent']:.2%})",
            str(run["foreign"]),
            str(counters.get("peer_moves", 0)),
            f"{counters.get('drop_source_budget', 0):,}",
            f"{run['rss_growth'] / 2**20:+.2f}",
        ]

    share = (flood["delivered"] / flood["sent"]) / (base["delivered"] / base["sent"])
    return [
        row("devices only (baseline)", base),
        row(f"devices + flood from {FLOOD_FROM}", flood),
        [
            "flood / baseline",
            "-",
            f"{share:.3f}",
            "-",
            "-",
            "-",
            f"{(flood['rss_growth'] - base['rss_growth']) / 2**20:+.2f} MB",
        ],
    ]


# ---- report --------------------------------------------------------------------------------------


def _impaired_rows(result: dict[str, Any]) -> list[list[Any]]:
    sent = result["sent"]
    rows = [
        ["datagrams sent", f"{sent:,}"],
        ["datagrams that reached the socket", f"{result['received']:,}"],
        [
            "frames delivered to sessions",
            f"{result['delivered']:,} ({result['delivered'] / sent:.1%} of sent)",
        ],
        ["dropped by the sequence rule (late or duplicate)", f"{result['dropped_by_sequence']:,}"],
        ["delivered out of order", str(result["delivered_out_of_order"])],
    ]
    if "lost_on_purpose" in result:
        rows.insert(
            1,
            [
                "lost / duplicated by the impairment",
                (f"{result['lost_on_purpose']:,} / {result['duplicated_on_purpose']:,}"),
            ],
        )
    return rows


async def run(quick: bool) -> str:
    quiet_logging()
    count = 5_000 if quick else 300_000  # quick: proves the bench runs (tests/test_bench_smoke)
    per_session = 50 if quick else 1_000
    seconds = 0.5 if quick else 20.0
    impaired_s = 1.0 if quick else 30.0

    process_rows = in_process(count)
    blasts = {"bare": [], "ours": []}
    for _round in range(1 if quick else 3):  # interleaved: the machine's noise hits both
        blasts["bare"].append(await blast_bare(per_session))
        blasts["ours"].append(await blast_ours(per_session))

    def per_delivered(runs: list[tuple[int, int, float]]) -> tuple[int, int, float]:
        sent = sum(r[0] for r in runs)
        got = sum(r[1] for r in runs)
        return sent, got, sum(r[2] for r in runs) / max(got, 1)

    bare_sent, bare_got, bare_cpu = per_delivered(blasts["bare"])
    ours_sent, ours_got, ours_cpu = per_delivered(blasts["ours"])
    socket_rows = [
        [
            "bare asyncio endpoint, counting only (baseline)",
            f"{bare_sent:,}",
            f"{bare_got:,}",
            f"{bare_cpu * 1e6:.2f}",
            f"{1 / bare_cpu:,.0f}",
        ],
        [
            "`UdpAudioChannel`",
            f"{ours_sent:,}",
            f"{ours_got:,}",
            f"{ours_cpu * 1e6:.2f}",
            f"{1 / ours_cpu:,.0f}",
        ],
    ]

    bare = await streams_share_bare(seconds)
    up = await streams_share(seconds, downlink=False)
    both = await streams_share(seconds, downlink=True)
    met = both["share"] <= TARGET_SHARE

    def per_datagram(result: dict[str, Any], handled: int) -> str:
        return f"{result['cpu_s'] / max(handled, 1) * 1e6:.1f}"

    stream_rows = [
        [
            "bare endpoint, uplink only (baseline)",
            f"{bare['uplink']:,}",
            "-",
            f"{bare['share']:.2%}",
            per_datagram(bare, bare["uplink"]),
        ],
        [
            "`UdpAudioChannel`, uplink",
            f"{up['uplink']:,}",
            "-",
            f"{up['share']:.2%}",
            per_datagram(up, up["uplink"]),
        ],
        [
            "`UdpAudioChannel`, uplink + downlink",
            f"{both['uplink']:,}",
            f"{both['downlink_sent']:,}",
            f"{both['share']:.2%}",
            per_datagram(both, both["uplink"] + both["downlink_sent"]),
        ],
    ]
    loopback = await impaired_loopback(impaired_s)
    skipped = await asyncio.to_thread(netem_setup)
    netem: dict[str, Any] | None = None
    if skipped is None:
        try:
            netem = await impaired_netem(impaired_s)
        finally:
            await asyncio.to_thread(netem_teardown)

    flood_s = 1.0 if quick else 20.0
    flood_base = await flood_run(flood_s, attack=False)
    flood = await flood_run(flood_s, attack=True)

    label = "quick run" if quick else "full run"
    parts = [
        "## UDP audio channel (MQTT transport)",
        "",
        f"`python -m bench.udp` ({environment()}), {label}. {__doc__.split(chr(10))[0]}",
        f"Payloads of {PAYLOAD} bytes, {STREAMS} sessions.",
        "",
        f"### Datagrams per CPU second, in process ({count:,} datagrams)",
        "",
        table(["path", "µs per datagram", "datagrams per CPU second"], process_rows),
        "",
        "### Datagrams per CPU second over loopback sockets",
        "",
        "A device process sends from 100 sockets as fast as it can; the figure is this "
        "process's CPU time (kernel receive, asyncio, and for ours the checks and decryption) "
        "per datagram it got. Datagrams the kernel dropped while the receiver was busy are "
        "the difference between sent and received.",
        "",
        table(
            ["receiver", "sent", "received", "CPU µs per datagram", "datagrams per CPU second"],
            socket_rows,
        ),
        "",
        f"### {STREAMS} concurrent {INTERVAL_MS} ms audio streams for {seconds:g} s",
        "",
        "Share of one core = CPU seconds of this process / wall seconds. The downlink row also "
        f"sends every session one {PAYLOAD}-byte datagram per {INTERVAL_MS} ms (as TTS would).",
        "",
        table(
            [
                "receiver",
                "uplink frames",
                "downlink frames sent",
                "share of one core",
                "CPU µs per datagram",
            ],
            stream_rows,
        ),
        "",
        "At this rate every datagram wakes the event loop on its own, so the CPU per datagram "
        "is higher than in the flood above, where the loop reads many per wake-up.",
        "",
        f"Target (our budget, not the issue's): {STREAMS} streams in both directions within "
        f"{TARGET_SHARE:.0%} of one core: {verdict(met)} ({both['share']:.2%}). "
        f"Downlink datagrams received by the devices: {both['downlink_received']:,}, "
        f"out of order: {both['downlink_out_of_order']}.",
        "",
        f"### Bad network: 5 % loss, 40 ms ± 20 ms delay, 1 % duplicates, {impaired_s:g} s",
        "",
    ]
    if netem is not None:
        parts += [
            "`tc netem` on both ends of a veth pair between two network namespaces "
            "(receiver in one, the 100 device sockets in the other).",
            "",
            table(["figure", "value"], _impaired_rows(netem)),
            "",
            f"Receiver exit code: {netem['receiver_exit']}.",
            "",
        ]
    else:
        parts += [
            f"`tc netem` run: **skipped** on this machine: {skipped}.",
            "",
            "The same impairment applied in the sending process instead (each uplink datagram "
            "dropped, duplicated or delayed by a normal draw before it is sent), over loopback:",
            "",
            table(["figure", "value"], _impaired_rows(loopback)),
            "",
        ]
    parts += [
        "Every datagram that arrived either reached its session in order or was dropped by "
        "the sequence rule (a late datagram behind a newer one, or a duplicate); nothing was "
        "delivered out of order and the endpoint kept running.",
    ]
    if loopback["delivered_out_of_order"] or (netem and netem["delivered_out_of_order"]):
        parts[-1] = "**Frames were delivered out of order: see the table.**"
    parts += _flood_section(flood_s, flood_base, flood)
    return "\n".join(parts)


def _flood_section(seconds: float, base: dict[str, Any], flood: dict[str, Any]) -> list[str]:
    counters = flood["counters"]
    held = flood["foreign"] == 0 and counters.get("peer_moves", 0) == 0
    sent_all = flood["sent"] + flood["flood_sent"]
    received = counters.get("rx_datagrams", 0)
    return [
        "",
        f"### Flood with known cookies from another address, {seconds:g} s",
        "",
        f"The channel in a process of its own; {FLOOD_DEVICES} devices stream one {PAYLOAD}-byte "
        f"frame per {INTERVAL_MS} ms from 127.0.0.1; the attacker, from {FLOOD_FROM}, sends "
        "datagrams with their cookies, sequences ahead of theirs and random ciphertext (no key) "
        "as fast as one process can. Delivered = frames that reached the devices' sessions; "
        "foreign = delivered frames that were not a device's; RSS growth of the channel process "
        "from ready to the end of the run. Same run, interleaved: baseline first.",
        "",
        table(
            [
                "run",
                "forged datagrams sent",
                "device frames delivered",
                "foreign",
                "peer moves",
                "dropped by the source budget",
                "RSS growth (MB)",
            ],
            _flood_rows(base, flood),
        ),
        "",
        f"No forged frame delivered and no peer moved: {verdict(held)}. "
        f"Datagrams sent in the flood run (devices + attacker): {sent_all:,}; received by the "
        f"channel: {received:,}; UDP receive-buffer overflows counted by the kernel during the "
        f"run (`RcvbufErrors`, whole machine): {flood['rcvbuf_errors']:,} (baseline run: "
        f"{base['rcvbuf_errors']:,}). Device frames that reach the channel from their own "
        "address are refused only as replays or sequence jumps.",
    ]


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
