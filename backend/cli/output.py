"""Console output shared by every command: results on stdout, one-line errors on stderr."""

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print one `error:` line (never wrapped, even in a pipe) and return the exit to raise."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def warn(message: str) -> None:
    err_console.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def say(text: str) -> None:
    console.print(text, highlight=False, markup=False, soft_wrap=True)
