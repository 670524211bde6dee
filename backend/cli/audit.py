"""`esp32-bridge audit`: the audit log of device tool calls, newest first (scope admin)."""

from typing import Annotated

import typer

from backend.cli.options import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    ServerOpt,
    TokenOpt,
    admin_client,
)
from backend.cli.output import console, listing, print_json, say


def audit(
    device: Annotated[str | None, typer.Option("--device", help="Only this device.")] = None,
    tool: Annotated[str | None, typer.Option("--tool", help="Only this tool.")] = None,
    actor: Annotated[
        str | None, typer.Option("--actor", help="Only this caller, e.g. key:<id> or admin.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="Entries.")] = 50,
    as_json: JsonOpt = False,
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
    table = listing(
        "at", "actor", "device_id", "tool", "outcome", "ms", "arguments sha256",
        ids=("actor", "device_id", "tool"),
    )  # fmt: skip
    for entry in entries:
        outcome = entry["outcome"] + (f" ({entry['error']})" if entry["error"] else "")
        if entry["confirmed"]:
            outcome += " confirmed"
        table.add_row(
            entry["at"],
            entry["actor"] or "",
            entry["device_id"],
            entry["tool"],
            outcome,
            f"{entry['duration_ms']:.1f}",
            entry["arguments_sha256"][:16],
        )
    console.print(table)
