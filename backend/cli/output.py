"""Console output shared by every command: results on stdout, one-line errors on stderr."""

import json
import sys
from collections.abc import Collection
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one `error:` line (never wrapped, even in a pipe) and return the exit to raise."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def warn(message: str) -> None:
    """Print a warning to stderr."""
    err_console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def say(text: str) -> None:
    """Print plain text to stdout (no markup, no highlighting)."""
    console.print(text, highlight=False, markup=False, soft_wrap=True)


def print_json(value: Any) -> None:
    """`--json`: one JSON document on stdout, for scripts (plain write: rich would wrap it)."""
    sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def listing(*columns: str, ids: Collection[str] = ()) -> Table:
    """A table whose `ids` columns are never cut: rich shrinks the other columns first, and
    folds an id onto a second line rather than end it with "…" on a very narrow terminal
    (an id is what one copies into the next command)."""
    table = Table()
    for name in columns:
        if name in ids:
            table.add_column(name, no_wrap=True, overflow="fold")
        else:
            table.add_column(name)
    return table
