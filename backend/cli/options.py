"""The options every admin command shares, spelled once, and the admin client they describe."""

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from backend.cli.client import AdminClient, AdminError
from backend.cli.local import admin_token, api_url, cli_settings
from backend.cli.output import fail

ConfigOpt = Annotated[Path | None, typer.Option("--config", help="TOML config file.")]
DataDirOpt = Annotated[
    Path | None, typer.Option("--data-dir", help="Where tokens and runtime files live.")
]
ServerOpt = Annotated[
    str | None, typer.Option("--server", help="Admin API URL [env: BRIDGE_SERVER].")
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token", help="Admin token, or a key with scope admin [env: BRIDGE_ADMIN_TOKEN]."
    ),
]


@contextlib.contextmanager
def admin_client(
    server: str | None, token: str | None, data_dir: Path | None, config: Path | None
) -> Iterator[AdminClient]:
    """A client for the local (or given) bridge, with the given token or the admin token. An
    `AdminError` in the block ends the command with its one-line message."""
    settings = cli_settings(config, data_dir=data_dir)
    token = token or admin_token(settings)
    if token is None:
        raise fail("no admin token: pass --token, set BRIDGE_ADMIN_TOKEN, or run `serve` once")
    try:
        with AdminClient(server or api_url(settings), token) as client:
            yield client
    except AdminError as exc:
        raise fail(str(exc)) from None
