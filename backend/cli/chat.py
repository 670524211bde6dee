"""`esp32-bridge chat`: talk to the dental assistant from a terminal, through the bridge's
`POST /api/chat/stream`. Tokens are printed as they arrive, one line per tool event; the
conversation goes on across lines (and can be resumed with `--conversation`).

Why a turn ran offline (no model service) is said once, on stderr, when it first happens or
changes, never in the answer; `--verbose` says it, and a failed web search, for every turn."""

import json
import os
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from backend.cli.client import AdminError
from backend.cli.options import ConfigOpt, DataDirOpt, ServerOpt, admin_client
from backend.cli.output import console, err_console, fail
from backend.common import clip

QUIT = frozenset({"/quit", "/exit", "/q"})


class ChatPrinter:
    """Renders seed 002's stream events: tokens inline, tool events and sources on own lines.

    `status`: where the turns' state goes (offline mode and why, on change; with `verbose`, every
    turn's, and a failed web search); None: nowhere (the demo says it once, before it chats)."""

    def __init__(
        self, out: Console, status: Console | None = None, *, verbose: bool = False
    ) -> None:
        self.out = out
        self.status = status
        self.verbose = verbose
        self._midline = False
        self._offline: str | None = None  # the reason last said
        self.conversation_id: str | None = None

    def event(self, event: dict[str, Any]) -> None:
        """Print one stream event."""
        kind = event.get("type")
        if kind == "token":
            text = str(event.get("token", ""))
            self.out.print(text, end="", markup=False, highlight=False, soft_wrap=True)
            self._midline = not text.endswith("\n")
        elif kind == "mcp_tool":
            self._line(_tool_line(event))
        elif kind == "sources":
            self._newline()
            self.out.print(
                "\n" + str(event.get("section", "")), markup=False, highlight=False, soft_wrap=True
            )
        elif kind == "done":
            self._newline()
            self.conversation_id = event.get("conversation_id") or self.conversation_id
            self._turn_status(event.get("metadata") or {})
        elif kind == "error":
            self._line(f"  error: {event.get('error')}")

    def _turn_status(self, metadata: dict[str, Any]) -> None:
        if self.status is None:
            return
        said: list[str] = []
        reason = (
            str(metadata.get("offline_reason") or "offline") if metadata.get("offline") else None
        )
        if reason is not None and (self.verbose or reason != self._offline):
            said.append(f"offline mode: {reason}")
        elif reason is None and self._offline is not None:
            said.append("the model answers again")
        self._offline = reason
        if self.verbose and metadata.get("search") == "failed":
            said.append(f"web search failed: {metadata.get('search_error')}")
        for line in said:
            self.status.print(f"({line})", style="dim", markup=False, highlight=False)

    def _line(self, text: str) -> None:
        self._newline()
        self.out.print(text, markup=False, highlight=False, soft_wrap=True)

    def _newline(self) -> None:
        if self._midline:
            self.out.print()
            self._midline = False


def _tool_line(event: dict[str, Any]) -> str:
    tool, status = event.get("tool"), event.get("status")
    if status == "started":
        return f"  [tool] {tool} {_compact(event.get('arguments') or {})}"
    if status == "completed":
        texts = [str(part.get("text", "")) for part in event.get("result") or []]
        flag = " (tool reported an error)" if event.get("is_error") else ""
        return f"  [tool] {tool} → {clip(' '.join(texts), 160)}{flag}"
    return f"  [tool] {tool} failed: {event.get('error')}"


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def chat(
    device: Annotated[
        str | None,
        typer.Option(
            "--device", metavar="DEVICE", help="Let the assistant use this device's tools."
        ),
    ] = None,
    conversation: Annotated[
        str | None,
        typer.Option("--conversation", metavar="ID", help="Continue this conversation id."),
    ] = None,
    server: ServerOpt = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            metavar="TOKEN",
            help="An API key with chat:use, or the admin token "
            "(env BRIDGE_API_KEY, else the admin token).",
        ),
    ] = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Say for every turn why it ran offline and why the web search failed "
            "(by default: offline mode once, on stderr, when it starts or its reason changes).",
        ),
    ] = False,
) -> None:
    """Chat with the dental assistant: type a line, get a streamed answer; /quit or Ctrl-D ends."""
    source = "--token"
    if not token and os.environ.get("BRIDGE_API_KEY"):
        token, source = os.environ["BRIDGE_API_KEY"], "BRIDGE_API_KEY"
    interactive = sys.stdin.isatty()
    printer = ChatPrinter(console, err_console, verbose=verbose)
    printer.conversation_id = conversation
    with admin_client(server, token, data_dir, config, token_source=source) as client:
        if interactive:
            console.print("[dim]Ask a dental question or give the device an order; /quit ends.")
        while True:
            line = _read(interactive)
            if line is None or line.strip() in QUIT:
                break
            if not line.strip():
                continue
            try:
                for event in client.chat(
                    line.strip(), conversation_id=printer.conversation_id, device_id=device
                ):
                    printer.event(event)
            except AdminError as exc:
                if not interactive:
                    raise fail(str(exc)) from None
                err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
    if printer.conversation_id:
        console.print(
            f"conversation {printer.conversation_id}", style="dim", highlight=False, markup=False
        )


def _read(interactive: bool) -> str | None:
    try:
        if interactive:
            return console.input("[bold]you>[/] ")
        line = sys.stdin.readline()
        return line if line else None
    except (EOFError, KeyboardInterrupt):
        if interactive:
            console.print()
        return None
