"""The options every admin command shares, spelled once."""

from pathlib import Path
from typing import Annotated

import typer

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
