"""Reliability: each attack of a hostile device against a live bridge, and what it costs others.

For every attack in `simulator.hostile`, a fresh `simulator.siege.Siege` (a real `esp32-bridge
serve` with JSON logs, well-behaved simulated devices called through the admin API every 50 ms,
`/healthz` probed every 50 ms, the bridge's RSS sampled every 20 ms) measures a window without an
attacker (the baseline of the same run), then the same window with the attack. The table goes to
docs/reliability.md (and its own section of docs/benchmarks.md).

Targets (issue #7): RSS growth under 20 MB per attacker, under 100 log lines per attacker per
minute, other devices' call p99 under 2× the no-attacker figure, `/healthz` always under 50 ms.
"""

import sys

from bench.common import REPO, bench_main, quiet_logging, raise_open_files, table, verdict
from bench.report import environment, write_section
from simulator.hostile import AttackReport
from simulator.siege import Attack, Siege, SiegeResult

NAME = "reliability"
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


def render(rows: list[Row], duration_s: float, quick: bool) -> str:
    lines = []
    missed = 0
    for label, base, hit in rows:
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
        missed += not met
        cut = _cut_off(report, hit.events)
        lines.append(
            [
                label,
                _sent(report),
                f"{hit.rss_growth_mb:.1f}",
                f"{hit.log_lines} ({per_min:.0f}/min)",
                f"{hit.call_p(99):.1f} / {base.call_p(99):.1f} = {ratio:.2f}",
                f"{hit.healthz_p(99):.1f} (max {healthz_max:.1f})",
                str(hit.call_errors),
                cut,
                verdict(met),
            ]
        )
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


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
