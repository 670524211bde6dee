"""Reliability: each attack of a hostile device against a live bridge, and what it costs others.

For every attack in `testkit.hostile`, a fresh `testkit.siege.Siege` (a real `esp32-bridge
serve` with JSON logs, well-behaved simulated devices called through the admin API every 50 ms,
`/healthz` probed every 50 ms, the bridge's RSS sampled every 20 ms) measures a window without an
attacker (the baseline of the same run), then the same window with the attack. The table goes to
docs/reliability.md (and its own section of docs/benchmarks.md).

The MQTT table (issue #16): the same measurement against `serve --mqtt embedded`, with simulated
MQTT devices as the others (`testkit.hostile_mqtt.MqttSiege`) and the attacks of
`testkit.hostile_mqtt`; each row also says whether a victim was acted for or went offline.
`--transport websocket|mqtt` runs one table only (default: both, each written to its section).

Targets (issue #7): RSS growth under 20 MB per attacker, under 100 log lines per attacker per
minute, other devices' call p99 under 2× the no-attacker figure, `/healthz` always under 50 ms.
"""

import argparse
import sys
from collections.abc import Awaitable, Callable

from bench.common import REPO, bench_main, quiet_logging, raise_open_files, table, verdict
from bench.report import environment, write_section
from testkit.hostile import AttackReport
from testkit.hostile_mqtt import MqttSiege, MqttSiegeResult, mqtt_attack
from testkit.siege import Attack, Siege, SiegeResult

NAME = "reliability"
MQTT_NAME = "reliability-mqtt"
RELIABILITY_DOC = REPO / "docs" / "reliability.md"
TARGET_RSS_MB = 20.0
TARGET_LINES_PER_MIN = 100.0
TARGET_P99_RATIO = 2.0
TARGET_HEALTHZ_MS = 50.0
ATTACK_S = 60.0  # a whole minute: the log target is per attacker per minute
BASELINE_S = 10.0


def attacks(duration_s: float) -> dict[str, Attack]:
    return {
        "ping flood (60 KB ids, never reading)": Attack("ping_flood", duration_s),
        "ping flood (never reading)": Attack("small_ping_flood", duration_s),
        "tools/list_changed storm": Attack("list_changed_storm", duration_s),
        "66,000 tools in 63 pages": Attack("tool_flood", duration_s),
        "log bomb (60 KB listen/abort, junk)": Attack("log_bomb", duration_s),
        "nesting bomb ([ × 30,000)": Attack("nesting_bomb", duration_s),
        "binary flood (60 KB frames)": Attack("binary_flood", duration_s),
        "oversize frame (70 KB)": Attack("oversize_frame", duration_s),
        "2,000 idle sockets": Attack("idle_sockets", 2000),
        "500 connections, one Device-Id": Attack("same_id_storm", 500),
        "300 devices dropping TCP after hello (shared token)": Attack("drop_after_hello", 300),
    }


def mqtt_attacks(duration_s: float, quick: bool) -> dict[str, Attack]:
    """Counts are the issue's; a quick run scales the slow ones down (each is time-bounded too)."""
    retained, churn, idle = (50, 100, 300) if quick else (1000, 2000, 5000)
    return {
        "will on another device's up/status topic, TCP abort": mqtt_attack(
            "mqtt_will_impersonation", duration_s
        ),
        "publish on / subscribe to another device's topics and #": mqtt_attack(
            "mqtt_foreign_topics", duration_s
        ),
        "one 64 MB PUBLISH (body streamed)": mqtt_attack("mqtt_big_publish", duration_s),
        "QoS 2 hoarding (no PUBREL)": mqtt_attack("mqtt_qos2_hoard", duration_s),
        "PUBACK/PUBREL spam, unknown ids": mqtt_attack("mqtt_ack_spam", duration_s),
        "QoS 2 id reuse": mqtt_attack("mqtt_qos2_reuse", duration_s),
        f"{retained:,} retained 60 KB messages": mqtt_attack("mqtt_retained_flood", retained),
        f"{churn:,} clean_session=0 logins (one device)": mqtt_attack("mqtt_session_churn", churn),
        f"{churn:,} parallel CONNECTs, one login": mqtt_attack("mqtt_same_login_storm", churn),
        f"{idle:,} idle sockets, one address (+ a legit login)": mqtt_attack(
            "mqtt_idle_sockets", idle
        ),
        "clean reconnect loop, one login": mqtt_attack("mqtt_reconnect_loop", duration_s),
    }


Row = tuple[str, SiegeResult, SiegeResult]


async def measure_all(duration_s: float, devices: int) -> list[Row]:
    rows = []
    baseline_s = min(duration_s, BASELINE_S)
    for label, attack in attacks(duration_s).items():
        async with Siege(devices) as siege:
            baseline = await siege.measure(None, baseline_s)
            attacked = await siege.measure(attack, duration_s)
        rows.append((label, baseline, attacked))
        print(f"{label}: done", file=sys.stderr, flush=True)
    return rows


async def measure_all_mqtt(duration_s: float, devices: int, quick: bool) -> list[Row]:
    rows: list[Row] = []
    baseline_s = min(duration_s, BASELINE_S)
    for label, attack in mqtt_attacks(duration_s, quick).items():
        async with MqttSiege(devices) as siege:
            baseline = await siege.measure(None, baseline_s)
            attacked = await siege.measure(attack, duration_s)
        rows.append((label, baseline, attacked))
        print(f"mqtt {label}: done", file=sys.stderr, flush=True)
    return rows


def _shared_figures(
    base: SiegeResult, hit: SiegeResult, duration_s: float
) -> tuple[list[str], bool]:
    """The cells every table has (sent, RSS, log lines, others' p99, /healthz, failed calls)
    and whether those figures meet the shared targets."""
    report = hit.attack
    assert report is not None
    minutes = max(duration_s, report.seconds) / 60
    per_min = hit.log_lines / minutes
    ratio = hit.call_p(99) / base.call_p(99) if base.call_ms else float("nan")
    healthz_max = max(hit.healthz_ms, default=float("nan"))
    met = (
        hit.rss_growth_mb < TARGET_RSS_MB
        and per_min < TARGET_LINES_PER_MIN
        and ratio < TARGET_P99_RATIO
        and healthz_max < TARGET_HEALTHZ_MS
        and hit.call_errors == 0
    )
    cells = [
        _sent(report),
        f"{hit.rss_growth_mb:.1f}",
        f"{hit.log_lines} ({per_min:.0f}/min)",
        f"{hit.call_p(99):.1f} / {base.call_p(99):.1f} = {ratio:.2f}",
        f"{hit.healthz_p(99):.1f} (max {healthz_max:.1f})",
        str(hit.call_errors),
    ]
    return cells, met


def render(rows: list[Row], duration_s: float, quick: bool) -> str:
    lines = []
    missed = 0
    for label, base, hit in rows:
        report = hit.attack
        assert report is not None
        cells, met = _shared_figures(base, hit, duration_s)
        missed += not met
        lines.append([label, *cells, _cut_off(report, hit.events), verdict(met)])
    headers = [
        "attack",
        "sent",
        "RSS growth MB",
        "log lines",
        "others' call p99 ms: attack / none",
        "/healthz p99 ms",
        "failed calls",
        "attacker cut off",
        "targets",
    ]
    quick_note = " — **quick run**" if quick else ""
    return f"""## Reliability: one hostile device against a live bridge

{environment()}{quick_note}. `python -m bench.reliability`.

Each row: a fresh bridge (`esp32-bridge serve`, JSON logs at the default level) with 4
simulated devices whose `set_volume` is called through the admin API every 50 ms while
`/healthz` is probed every 50 ms; a {min(duration_s, BASELINE_S):g} s window without an attacker
(the baseline), then a {duration_s:g} s window with one attacker holding only the device token.
"RSS growth" is the bridge's peak RSS during the attack minus its RSS just before; "log lines"
counts every line the bridge wrote from the attack's start until 1 s after its end. An attacker
cut off by a bound reconnects (every 0.5 s while refused) and attacks again until the window
ends.

{table(headers, lines)}

Targets: RSS growth < {TARGET_RSS_MB:g} MB, < {TARGET_LINES_PER_MIN:g} log lines per minute,
others' call p99 < {TARGET_P99_RATIO:g}× the no-attacker figure, `/healthz` always under
{TARGET_HEALTHZ_MS:g} ms, no failed call of another device: {_overall(missed, len(rows))}.
"""


def render_mqtt(rows: list[Row], duration_s: float, quick: bool) -> str:
    lines = []
    missed = 0
    for label, base, hit in rows:
        report = hit.attack
        assert report is not None and isinstance(hit, MqttSiegeResult)
        cells, met = _shared_figures(base, hit, duration_s)
        legit = report.detail.get("legit_connack", 0)
        met = (
            met
            and not hit.victim_affected
            and not report.detail.get("accepted")  # a will on another's topic, taken
            and not report.detail.get("session_present")
            and legit == 0
        )
        missed += not met
        victim = (
            f"acted for: {hit.acted_as_victim}, offline: {hit.victim_disconnects}"
            if hit.victim_affected
            else "no"
        )
        lines.append([label, *cells, victim, _answered(report), verdict(met)])
    headers = [
        "attack",
        "sent",
        "RSS growth MB",
        "log lines",
        "others' call p99 ms: attack / none",
        "/healthz p99 ms",
        "failed calls",
        "victim affected",
        "the bridge's answer",
        "targets",
    ]
    quick_note = " — **quick run**" if quick else ""
    return f"""## Reliability over MQTT: one hostile device against the embedded endpoint

{environment()}{quick_note}. `python -m bench.reliability --transport mqtt`.

As the WebSocket table, against `esp32-bridge serve --mqtt embedded` (the bridge's own MQTT
endpoint, loopback, `rate_limit_exempt = []` so loopback is limited like the LAN, shared-mode
derived broker logins) with 4 simulated MQTT devices (`esp32-bridge simulate --transport mqtt`)
as the others: `set_volume` called on them through the admin API every 50 ms, `/healthz` probed
every 50 ms, a {min(duration_s, BASELINE_S):g} s baseline, then a {duration_s:g} s window with
the attack. The attacker is an approved device logged in with its own broker login (or, for the
idle sockets, no login), connecting from 127.0.0.2; the legitimate login during the idle
sockets comes from 127.0.0.3. "Victim affected": a `listen` or `device turn` line in a victim's
name (the victims never type), an audit entry by `device:<victim>`, or a victim's "device
disconnected" line during the window.
"The bridge's answer": CONNACK return codes (0 accepted, 3 server unavailable: a rate limit,
5 not authorized; "dropped": closed at accept by a per-address bound) and what else it reports.

{table(headers, lines)}

Targets: as above, plus no victim acted for or taken offline, no will on another device's topic
accepted, no session kept, the legitimate login accepted: {_overall(missed, len(rows))}.
"""


def _answered(report: AttackReport) -> str:
    detail = report.detail
    parts = []
    connacks = detail.get("connacks")
    if connacks:
        codes = ", ".join(f"{code}: {count:,}" for code, count in sorted(connacks.items()))
        parts.append(f"CONNACK {codes}")
    for name in ("accepted", "session_present", "still_open", "closed_by_bridge"):
        if name in detail:
            parts.append(f"{name.replace('_', ' ')} {detail[name]:,}")
    if "legit_connack" in detail:
        parts.append(f"legit CONNACK {detail['legit_connack']} in {detail['legit_login_ms']} ms")
    if "body_bytes_sent" in detail:
        parts.append(f"body bytes taken before the cut {detail['body_bytes_sent']:,}")
    received = detail.get("received")
    if received:
        names = {"3": "PUBLISH (its own downlink)", "4": "PUBACK", "5": "PUBREC"}
        names.update({"7": "PUBCOMP", "9": "SUBACK"})
        got = ", ".join(f"{names.get(str(k), k)} {v:,}" for k, v in sorted(received.items()))
        parts.append(f"got back {got}")
    if report.close_code is not None:
        parts.append("cut off")
    return "; ".join(parts) or "-"


def _sent(report: AttackReport) -> str:
    """What the attacker sent; for a persistent one, over how many links and refusals."""
    text = f"{report.sent:,} in {report.seconds:.1f} s"
    links, refused = report.detail.get("links"), report.detail.get("refused_handshakes")
    if links is None:
        return text
    return f"{text}, {links} link(s), {refused} refused handshake(s)"


def _cut_off(report: AttackReport, events: dict[str, int]) -> str:
    """The attacker's close code where it saw one; a never-reading attacker may not see our
    close frame, so the bridge's own "device cut off" line counts too."""
    if report.cut_off:
        return f"yes ({report.close_code})"
    return "yes (1008, unseen)" if events.get("device cut off") else "no"


def _overall(missed: int, attacks: int) -> str:
    if missed == 0:
        return f"{verdict(True)} for all {attacks} attacks"
    return f"{verdict(False)} for {missed} of {attacks} attacks"


async def run(quick: bool) -> str:
    quiet_logging()
    raise_open_files(8192)
    duration_s = 2.0 if quick else ATTACK_S
    rows = await measure_all(duration_s, 4)
    markdown = render(rows, duration_s, quick)
    if not quick:
        write_section(NAME, markdown, RELIABILITY_DOC)  # the figures section of that page
    return markdown


async def run_mqtt(quick: bool) -> str:
    quiet_logging()
    raise_open_files(12_000)  # the idle-socket attacker inherits it
    duration_s = 2.0 if quick else ATTACK_S
    rows = await measure_all_mqtt(duration_s, 4, quick)
    markdown = render_mqtt(rows, duration_s, quick)
    if not quick:
        write_section(MQTT_NAME, markdown, RELIABILITY_DOC)
    return markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--transport", choices=("all", "websocket", "mqtt"), default="all")
    args, rest = parser.parse_known_args(argv if argv is not None else sys.argv[1:])
    runs: list[tuple[str, Callable[[bool], Awaitable[str]]]] = []
    if args.transport in ("all", "websocket"):
        runs.append((NAME, run))
    if args.transport in ("all", "mqtt"):
        runs.append((MQTT_NAME, run_mqtt))
    for name, runner in runs:
        bench_main(name, __doc__ or name, runner, rest)


if __name__ == "__main__":
    main()
