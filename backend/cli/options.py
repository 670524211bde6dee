"""The options every admin command shares, spelled once, and the admin client they describe."""

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from backend.cli.client import AdminClient, AdminError
from backend.cli.local import (
    admin_token,
    admin_token_source,
    api_url_and_hint,
    cli_settings,
    no_admin_token,
)
from backend.cli.output import fail

JsonOpt = Annotated[
    bool,
    typer.Option("--json", help="Print one JSON document (the API's rows) instead of a table."),
]
WideOpt = Annotated[
    bool,
    typer.Option(
        "--wide",
        help="Every column at full width, on one line per row (lines may run past the terminal).",
    ),
]
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", metavar="FILE", help="TOML config file.")
]
DataDirOpt = Annotated[
    Path | None,
    typer.Option("--data-dir", metavar="DIR", help="Where tokens and runtime files live."),
]
ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server",
        metavar="URL",
        help="Admin API URL \\[env: BRIDGE_SERVER; default: the bridge of --data-dir].",
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        metavar="TOKEN",
        help="The admin token, or an API key with the scope the command needs "
        "\\[env: BRIDGE_ADMIN_TOKEN; default: the data directory's admin.token].",
    ),
]


@contextlib.contextmanager
def admin_client(
    server: str | None,
    token: str | None,
    data_dir: Path | None,
    config: Path | None,
    *,
    token_source: str = "--token",
) -> Iterator[AdminClient]:
    """A client for the local (or given) bridge, with the given token (from `token_source`) or
    the admin token. An `AdminError` in the block ends the command with its one-line message."""
    settings = cli_settings(config, data_dir=data_dir)
    if not token:
        token = admin_token(settings)
        token_source = admin_token_source(settings)
    if token is None:
        raise fail(no_admin_token(settings))
    url, hint = api_url_and_hint(settings, server)
    try:
        with AdminClient(url, token, token_source=token_source, unreachable_hint=hint) as client:
            yield client
    except AdminError as exc:
        raise fail(str(exc)) from None
