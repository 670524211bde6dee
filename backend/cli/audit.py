"""`esp32-bridge audit`: the audit log of device tool calls, newest first (scope admin)."""

from typing import Annotated, Any

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
from backend.cli.output import Listing, listing, print_json, say, show, when


def audit(
    device: Annotated[
        str | None, typer.Option("--device", metavar="DEVICE", help="Only this device.")
    ] = None,
    tool: Annotated[
        str | None, typer.Option("--tool", metavar="TOOL", help="Only this tool.")
    ] = None,
    actor: Annotated[
        str | None,
        typer.Option("--actor", metavar="ACTOR", help="Only this caller, e.g. key:<id> or admin."),
    ] = None,
    limit: Annotated[
        int,
        typer.Option(
            "--limit",
            metavar="N",
            min=1,
            max=1000,
            help="How many entries, newest first (1 to 1000).",
        ),
    ] = 50,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Who called which device tool, when, with which outcome (arguments as a SHA-256)."""
    params = {"limit": str(limit)}
    for name, value in (("device_id", device), ("tool", tool), ("actor", actor)):
        if value is not None:
            params[name] = value
    with admin_client(server, token, data_dir, config) as admin:
        entries = admin.get("/api/audit", params)["entries"]
    if as_json:
        print_json(entries)
        return
    if not entries:
        say("no tool calls recorded")
        return
    show(audit_table(entries, wide=wide))


def audit_table(entries: list[dict[str, Any]], *, wide: bool = False) -> Listing:
    """The `audit` table, newest first as the API answers (the arguments' SHA-256 cut to 12
    digits; --json has it whole)."""
    table = listing(
        "at", "actor", "device_id", "tool", "outcome", "ms", "args_sha256",
        ids=("actor", "device_id", "tool"), wide=wide,
    )  # fmt: skip
    for entry in entries:
        outcome = entry["outcome"] + (f" ({entry['error']})" if entry["error"] else "")
        if entry["confirmed"]:
            outcome += " confirmed"
        table.add_row(
            when(entry["at"]),
            entry["actor"] or "",
            entry["device_id"],
            entry["tool"],
            outcome,
            f"{entry['duration_ms']:.1f}",
            entry["arguments_sha256"][:12],
        )
    return table
