"""`esp32-bridge cluster status|drain`: the instances serving one fleet (docs/cluster.md)."""

import time
from typing import Any

import typer

from backend.cli.options import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    ServerOpt,
    TokenOpt,
    WideOpt,
    admin_client,
)
from backend.cli.output import Listing, listing, print_json, say, show

DRAIN_POLL_S = 0.5

cluster_app = typer.Typer(
    help="Several bridge instances on one fleet: who is alive, who owns what (docs/cluster.md).",
    no_args_is_help=True,
)


@cluster_app.command("status")
def status(
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Instances (alive, draining, heartbeat lag, devices, MQTT shards) and leases."""
    with admin_client(server, token, data_dir, config) as admin:
        answer = admin.get("/api/cluster")
    if as_json:
        print_json(answer)
        return
    if not answer.get("enabled"):
        say("this bridge is not in a cluster (cluster_url is not set): one instance")
        return
    show(instances_table(answer, wide=wide))
    leases, fleet = answer["leases"], answer["fleet"]
    say(
        f"leases: {leases['live']} live, {leases['expired']} expired (ttl {answer['lease_ttl_s']:g}"
        f" s); this instance ({answer['instance']}): {fleet['local']} devices here, "
        f"{fleet['remote']} on the others"
        + ("; FENCED (database unreachable)" if answer["fenced"] else "")
        + ("" if answer["broker_connected"] else "; cluster broker NOT connected")
    )


def instances_table(answer: dict[str, Any], *, wide: bool = False) -> Listing:
    """The `cluster status` table: one row per instance, this one marked `(this)`."""
    table = listing(
        "instance", "alive", "draining", "lag_s", "devices", "shards", "api",
        ids=("instance",), prose=("shards",), wide=wide,
    )  # fmt: skip
    for row in answer["instances"]:
        table.add_row(*_row(row, answer["instance"]))
    return table


def _row(row: dict[str, Any], me: str) -> list[str]:
    lag = row["heartbeat_lag_s"]
    shards = row["shards"]
    return [
        row["instance_id"] + (" (this)" if row["instance_id"] == me else ""),
        "yes" if row["alive"] else "no",
        "yes" if row["draining"] else "",
        "" if lag is None else f"{lag:.1f}",
        str(row["devices"]),
        ", ".join(map(str, shards)) if shards else "",
        row["api_url"] or "",
    ]


@cluster_app.command("drain")
def drain(
    as_json: JsonOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Drain this instance and wait until it is done: readiness answers 503 at once so the
    balancer stops sending devices; after drain_notice_s its devices are told to reconnect (they
    land on another instance) at drain_rate_per_s, each once its tool calls finished."""
    with admin_client(server, token, data_dir, config) as admin:
        answer = admin.post("/api/cluster/drain")
        shown = None
        while answer.get("phase", "done") != "done":
            line = _progress(answer)
            if line != shown and not as_json:
                say(line)
                shown = line
            time.sleep(DRAIN_POLL_S)
            answer = {"instance": answer["instance"], **admin.get("/api/cluster")["drain"]}
    if as_json:
        print_json(answer)
        return
    told = answer["devices_told"]
    say(
        f"instance {answer['instance']} draining: {told} devices told to reconnect"
        f" ({answer.get('elapsed_s', 0):.1f} s)"
    )


def _progress(answer: dict[str, Any]) -> str:
    if answer["phase"] == "notice":
        return "readiness 503: waiting for the balancer to notice (drain_notice_s)"
    return f"moving devices: {answer['devices_told']} told, {answer['devices_left']} left"
