"""`esp32-bridge keys create|list|revoke`: scoped API keys, through the admin API (scope admin).

The token is printed once, at creation; the bridge keeps only its SHA-256.
"""

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
from backend.keys import Scope
from backend.keys.store import parse_scopes

keys_app = typer.Typer(
    help="Scoped API keys for the chat APIs, /mcp and device access (needs the admin token).",
    no_args_is_help=True,
)

SCOPE_HELP = (
    "A scope: "
    + ", ".join(scope.value for scope in Scope)
    + ", or mcp:<server> for an external MCP server (repeat for more). mcp:endpoint: an MCP"
    " server may dial in with the key; mcp:dialin: every dialed-in server's tools (chat, /mcp)."
)


def _checked_scopes(values: list[str]) -> list[str]:
    """A usage error (exit 2) here, before asking the bridge, as for any other bad option."""
    try:
        parse_scopes(values)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return values


@keys_app.command("create")
def create(
    name: Annotated[
        str, typer.Argument(metavar="NAME", help="What the key is for, e.g. 'kitchen app'.")
    ],
    scope: Annotated[
        list[str],
        typer.Option("--scope", metavar="SCOPE", help=SCOPE_HELP, callback=_checked_scopes),
    ],
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device", metavar="DEVICE", help="Limit device access to this device id (repeatable)."
        ),
    ] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Create a key and print its token (shown this once only)."""
    with admin_client(server, token, data_dir, config) as admin:
        key = admin.create_key(name, list(scope), device or None)
    devices = ", ".join(key["device_ids"]) if key["device_ids"] else "all devices"
    say(f"created key {key['id']} ({key['name']}): {', '.join(key['scopes'])}; {devices}")
    say("token (shown once, store it now):")
    say(key["token"])


@keys_app.command("list")
def list_keys(
    active: Annotated[
        bool,
        typer.Option(
            "--active/--revoked",  # --revoked (list them too, the default) kept for scripts
            show_default=False,
            help="--active: only active keys (by default revoked ones are listed too).",
        ),
    ] = False,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """List keys (never their tokens)."""
    with admin_client(server, token, data_dir, config) as admin:
        keys = admin.keys(include_revoked=not active)
    if as_json:
        print_json(keys)
        return
    if not keys:
        say("no keys")
        return
    show(keys_table(keys, wide=wide))


def keys_table(keys: list[dict[str, Any]], *, wide: bool = False) -> Listing:
    """The `keys list` table (never a token: the bridge keeps only their hashes)."""
    table = listing(
        "id", "name", "scopes", "devices", "created_at", "last_used_at", "status",
        ids=("id",), prose=("name", "scopes", "devices"), wide=wide,
    )  # fmt: skip
    for key in keys:
        table.add_row(
            key["id"],
            key["name"],
            ", ".join(key["scopes"]),
            ", ".join(key["device_ids"]) if key["device_ids"] else "all",
            when(key["created_at"]),
            when(key["last_used_at"]) or "never",
            "active" if key["active"] else f"revoked {when(key['revoked_at'])}",
        )
    return table


@keys_app.command("revoke")
def revoke(
    key_id: Annotated[
        str, typer.Argument(metavar="KEY_ID", help="The key's id (see `keys list`).")
    ],
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Revoke a key: it stops working at once."""
    with admin_client(server, token, data_dir, config) as admin:
        key = admin.revoke_key(key_id)
    say(f"revoked key {key['id']} ({key['name']})")
