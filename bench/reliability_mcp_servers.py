"""Reliability: a hostile MCP server dialed in to a live bridge, and what it costs others
(issue #32, item 1).

A `testkit.siege.Siege` (a real `esp32-bridge serve` with JSON logs, simulated devices called
through the admin API every 50 ms, `/healthz` probed every 50 ms, the bridge's RSS sampled every
20 ms) measures a window without an attacker (the baseline of the same run), then the window of
the attack: `testkit.hostile_mcp_server` in its own process dials in with a key bound to one
simulated device and offers 50 pages of ~1 MiB of tools (500 tools with ~95 KB input schemas,
over-long and bad-charset names, a 40-deep schema), then sends `tools/list_changed` every 20 ms
until it leaves. Reported: the bridge's RSS growth during the attack and after the server left,
its log lines a minute, another device's tool-call p99 against the baseline, `/healthz`, and the
re-lists the attacker got.

Targets (as bench/reliability.py): RSS growth under 20 MB, under 100 log lines a minute, other
devices' call p99 under 2× the no-attacker figure, `/healthz` always under 50 ms; re-lists at
most one per 2 s.
"""

import asyncio
import json
import sys

from bench.common import bench_main, quiet_logging, table, verdict
from bench.report import environment
from simulator.fleet import device_id_for
from testkit.hostile import AttackReport
from testkit.siege import Attack, Siege

NAME = "reliability-mcp-servers"
TARGET_RSS_MB = 20.0
TARGET_LINES_PER_MIN = 100.0
TARGET_P99_RATIO = 2.0
TARGET_HEALTHZ_MS = 50.0
ATTACK_S = 60.0
BASELINE_S = 10.0


class DialInSiege(Siege):
    """A siege whose attacker is an MCP server dialing in (a key bound to the first device)."""

    hostile: dict[str, object] | None = None

    async def _attack(self, attack: Attack) -> AttackReport:
        assert self._api is not None
        body = {"name": "hostile", "scopes": ["mcp:endpoint"], "device_ids": [device_id_for(1)]}
        created = await self._api.post("/api/keys", json=body)
        created.raise_for_status()
        token = created.json()["token"]
        url = self.api_url.replace("http://", "ws://") + f"/v1/mcp-endpoint/?token={token}"
        argv = [sys.executable, "-m", "testkit.hostile_mcp_server", url, str(attack.amount)]
        process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
        out, _ = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"the hostile server failed with status {process.returncode}")
        self.hostile = json.loads(out.decode().strip().splitlines()[-1])
        sent = int(str(self.hostile["notifications"]))
        return AttackReport("hostile MCP server", sent=sent, seconds=attack.amount)


async def run(quick: bool) -> str:
    quiet_logging()
    attack_s = 5.0 if quick else ATTACK_S
    baseline_s = 3.0 if quick else BASELINE_S
    async with DialInSiege(devices=2) as siege:
        base = await siege.measure(None, baseline_s)
        idle_rss = siege.rss_mb()
        hit = await siege.measure(Attack("dialin", attack_s), attack_s, settle_s=3.0)
        left_rss = siege.rss_mb()
        hostile = siege.hostile or {}
    minutes = attack_s / 60
    per_min = hit.log_lines / minutes
    ratio = hit.call_p(99) / base.call_p(99) if base.call_ms else float("nan")
    healthz_max = max(hit.healthz_ms, default=float("nan"))
    relists = int(str(hostile.get("relists", 0)))
    gap = hostile.get("min_relist_gap_s")
    gap_text = f"{float(str(gap)):.2f}" if gap is not None else "—"
    met = (
        hit.rss_growth_mb < TARGET_RSS_MB
        and per_min < TARGET_LINES_PER_MIN
        and ratio < TARGET_P99_RATIO
        and healthz_max < TARGET_HEALTHZ_MS
        and hit.call_errors == 0
        and relists <= attack_s / 2 + 1
    )
    rows = [
        [
            "notifications sent / tools/list requests answered",
            f"{hostile.get('notifications')} / {hostile.get('tools_list')}",
        ],
        [
            "re-lists (first-page requests after the handshake) / shortest gap (s)",
            f"{relists} / {gap_text}",
        ],
        [
            "bridge RSS before / peak growth during the attack (MB)",
            f"{hit.rss_before_mb:.1f} / +{hit.rss_growth_mb:.1f}",
        ],
        [
            "bridge RSS after the server left, against before (MB)",
            f"{left_rss:.1f} ({left_rss - idle_rss:+.1f})",
        ],
        ["bridge log lines during the attack", f"{hit.log_lines} ({per_min:.0f}/min)"],
        [
            "another device's tool call p99: attack / idle (ms)",
            f"{hit.call_p(99):.1f} / {base.call_p(99):.1f} = {ratio:.2f}",
        ],
        [
            "`/healthz` p99 (max) during the attack (ms)",
            f"{hit.healthz_p(99):.1f} (max {healthz_max:.1f})",
        ],
        ["failed calls of other devices", str(hit.call_errors)],
        ["lines with an exception", str(len(hit.errors))],
    ]
    quick_note = " — **quick run**" if quick else ""
    return f"""## Reliability: a hostile dialed-in MCP server

{environment()}{quick_note}. `python -m bench.reliability_mcp_servers`: a live bridge
(`esp32-bridge serve`, JSON logs), 2 simulated devices called every 50 ms through the admin API;
a hostile MCP server dials in with a key bound to one of them, offers 50 pages of ~1 MiB of
tools (500 tools with ~95 KB schemas, over-long and bad-charset names, a 40-deep schema) and
sends `tools/list_changed` every 20 ms for {attack_s:.0f} s, then leaves. Baseline: the same
calls for {baseline_s:.0f} s before, in the same run.

{table(["figure", "measured"], rows)}

Targets: RSS growth under {TARGET_RSS_MB:.0f} MB, under {TARGET_LINES_PER_MIN:.0f} log lines a
minute, the other device's p99 under {TARGET_P99_RATIO:.0f}× idle, `/healthz` under
{TARGET_HEALTHZ_MS:.0f} ms, at most one re-list per 2 s:
{verdict(met and not quick)}.
"""


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
