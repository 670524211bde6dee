"""Console output shared by every command: results on stdout, one-line errors on stderr.

Nothing a command prints from data is read as rich markup or emoji codes: the consoles have
`emoji=False` (an actor `chat:key:bcdc…` would otherwise show a key emoji) and data goes through
`say`, `escape` or `Text`, never through a markup string.
"""

import json
import math
import sys
from collections.abc import Collection, Iterator
from datetime import UTC, datetime
from typing import Any

import typer
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.markup import escape
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)


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


def when(value: str | None) -> str:
    """An API time (ISO 8601) as a table shows it: UTC to the second, `2026-11-29 15:31:30Z`
    (a date and a time that wrap apart on a narrow terminal); anything else as it is."""
    if not value:
        return ""
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return value
    if moment.tzinfo is None:
        return moment.strftime("%Y-%m-%d %H:%M:%S")
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


# ---- listings -----------------------------------------------------------------------------------

# A value this short is never folded (a state, a count, a version).
SHORT = 12
# The narrowest a `prose` column (a description, an error) gets before the vertical layout.
PROSE_MIN = 18


class Listing:
    """The table of a listing command, laid out for the width it is printed at.

    - `ids` (what one copies into the next command: device ids, codes, names) are never shrunk
      below their content, nor folded;
    - the other columns keep their header whole and fold their values onto a second line when
      the rows do not fit (`prose` columns, free text, onto as many lines as they need);
    - when even that does not fit, each row is printed as a block of `header: value` lines;
    - `wide`: every column at its full width, lines may run past the terminal.

    Cells are plain text (a `str`, never read as markup) or a rich `Text`."""

    def __init__(
        self,
        *columns: str,
        ids: Collection[str] = (),
        prose: Collection[str] = (),
        wide: bool = False,
        title: str | None = None,
    ) -> None:
        self.columns = list(columns)
        self.ids = frozenset(ids)
        self.prose = frozenset(prose)
        self.wide = wide
        self.title = title
        self.rows: list[list[Text]] = []

    def add_row(self, *cells: str | Text | None) -> None:
        """One row, a cell per column (None: empty)."""
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([c if isinstance(c, Text) else Text(c or "") for c in cells])

    def layout(self, console: Console, width: int) -> list[int] | None:
        """The column widths at `width` columns (natural ones when `wide`), or None: vertical."""
        natural = [self._natural(i) for i in range(len(self.columns))]
        if self.wide or self._total(natural) <= width:
            return natural
        minimum = [self._minimum(console, i, natural[i]) for i in range(len(self.columns))]
        if self._total(minimum) > width:
            return None
        return _spread(minimum, natural, width - self._total(minimum))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths = self.layout(console, options.max_width)
        if widths is None:
            yield from self._vertical(console, options.max_width)
            return
        table = Table(
            title=self.title,
            title_justify="left",
            box=box.SIMPLE_HEAD,  # a rule under the headers; two spaces between columns
            show_edge=False,
            pad_edge=False,
            padding=(0, 1, 0, 0),
        )
        for name, size in zip(self.columns, widths, strict=True):
            key = name in self.ids
            table.add_column(name, width=size, no_wrap=key, overflow="fold")
        for row in self.rows:
            table.add_row(*row)
        # Wide: rendered at its own width (`show` prints it uncropped).
        render_options = options.update_width(max(self._total(widths), 1))
        yield from _trimmed(console.render_lines(table, render_options, pad=False))

    def _vertical(self, console: Console, width: int) -> Iterator[Text]:
        """Each row as a block of `header: value` lines, a blank line between blocks; a value
        too long for its line folds onto the next ones, indented, or starts below its header on
        a terminal too narrow for both."""
        if self.title:
            yield Text(self.title)
        indent = max(cell_len(name) for name in self.columns) + 2
        below = width - indent < SHORT
        room = width - 2 if below else width - indent
        for number, row in enumerate(self.rows):
            if number:
                yield Text("")
            for name, cell in zip(self.columns, row, strict=True):
                if not cell.plain and name not in self.ids:
                    continue
                lines = (
                    list(cell.wrap(console, max(room, 1), overflow="fold")) if cell.plain else []
                )
                for line in lines:
                    line.rstrip()
                label = Text(f"{name}:", style="bold")
                if below:
                    yield label
                    yield from (Text("  ") + line for line in lines)
                    continue
                label.pad_right(indent - cell_len(label.plain))
                yield label + (lines[0] if lines else Text(""))
                yield from (Text(" " * indent) + line for line in lines[1:])

    def _natural(self, index: int) -> int:
        header = cell_len(self.columns[index])
        return max([header, *(_longest_line(row[index]) for row in self.rows)])

    def _minimum(self, console: Console, index: int, natural: int) -> int:
        name = self.columns[index]
        header = cell_len(name)
        if name in self.ids or natural <= SHORT:
            return natural
        if name in self.prose:
            return max(header, min(natural, PROSE_MIN))
        # The narrowest width at which every value takes at most two lines.
        unique = {row[index].plain: row[index] for row in self.rows}
        cells = sorted(unique.values(), key=lambda cell: -cell_len(cell.plain))
        for size in range(max(header, math.ceil(natural / 2)), natural):
            if all(len(cell.wrap(console, size, overflow="fold")) <= 2 for cell in cells):
                return size
        return natural

    @staticmethod
    def _total(widths: list[int]) -> int:
        """The table's width: the columns and two spaces between each two."""
        return sum(widths) + 2 * (len(widths) - 1)


def _longest_line(text: Text) -> int:
    return max((cell_len(line) for line in text.plain.split("\n")), default=0)


def _spread(minimum: list[int], natural: list[int], extra: int) -> list[int]:
    """Share `extra` columns among the columns below their natural width: whole first to those
    that lack least (each one made whole is one folded column fewer), the rest in proportion
    to what each lacks."""
    widths = list(minimum)
    for i in sorted(range(len(widths)), key=lambda i: natural[i] - widths[i]):
        lacking = natural[i] - widths[i]
        if 0 < lacking <= extra:
            widths[i] = natural[i]
            extra -= lacking
    wanting = [i for i, size in enumerate(widths) if size < natural[i]]
    lacking = sum(natural[i] - widths[i] for i in wanting)
    for i in wanting:
        share = min(extra * (natural[i] - widths[i]) // lacking, natural[i] - widths[i])
        widths[i] += share
    return widths


def _trimmed(lines: list[list[Segment]]) -> Iterator[Segment]:
    """Rendered lines without the spaces rich pads them with, each ended by a newline."""
    for line in lines:
        while line and not line[-1].text.strip() and not line[-1].control:
            line = line[:-1]
        if line:
            last = line[-1]
            line = [*line[:-1], Segment(last.text.rstrip(), last.style, last.control)]
        yield from line
        yield Segment.line()


def listing(
    *columns: str,
    ids: Collection[str] = (),
    prose: Collection[str] = (),
    wide: bool = False,
    title: str | None = None,
) -> Listing:
    """A `Listing` with these columns (see there)."""
    return Listing(*columns, ids=ids, prose=prose, wide=wide, title=title)


def show(table: Listing, out: Console | None = None) -> None:
    """Print a listing on stdout; a `--wide` one runs past the terminal instead of being cut."""
    (out or console).print(table, crop=False)
