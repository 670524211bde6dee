"""Reading what the CLI prints, for tests in several modules."""

import re


def table(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """A CLI table's header and its rows by first cell (each cell starts under its header; the
    header rule is the line of `─` under it). For a table printed wide enough to keep each row
    on one line."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if line and set(line) == {"─"})
    starts = [match.start() for match in re.finditer(r"\S+", lines[rule - 1])]

    def cells(line: str) -> list[str]:
        return [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]

    rows = [cells(line) for line in lines[rule + 1 :] if line.strip()]
    return cells(lines[rule - 1]), {row[0]: row[1:] for row in rows}
