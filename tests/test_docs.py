"""The reference pages stay true: every setting and every command is documented, nothing
documented is gone, and every relative link in the README and docs/ leads to a file."""

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from backend.cli.main import app
from backend.config import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def first_cells(page: Path) -> list[str]:
    """The first cell of every table row of a page."""
    return [line.split("|")[1] for line in page.read_text().splitlines() if line.startswith("| `")]


def commands(group: Any, prefix: str = "") -> Iterator[str]:
    """Every visible command of the CLI, as typed: "devices pending"."""
    for name, command in group.commands.items():
        if command.hidden:
            continue
        if hasattr(command, "commands"):
            yield from commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}"


def documented_commands() -> set[str]:
    """The commands docs/cli.md's table names: "`devices pending [--json]`" and
    "`firmware build / deploy / flash / run-host`" (a group's commands written together);
    a name ends at its first option ("`simulate --transport mqtt`" is `simulate`)."""
    found: set[str] = set()
    for cell in first_cells(DOCS / "cli.md"):
        for usage in re.findall(r"`([a-z][a-z /-]*)", cell):
            words = usage.split(" /")[0].split(" -")[0].split()
            found.add(" ".join(words))
            if " / " in usage:  # "firmware build / deploy": the group's first word, each other
                group = words[0]
                found |= {f"{group} {other.strip()}" for other in usage.split("/")[1:]}
    return found


def test_every_setting_is_in_the_configuration_page_and_only_settings_are() -> None:
    named = {
        name
        for cell in first_cells(DOCS / "configuration.md")
        for name in re.findall(r"`([a-z_0-9]+)`", cell)
    }
    fields = set(Settings.model_fields)
    assert fields - named == set(), "settings missing from docs/configuration.md"
    assert named - fields == set(), "docs/configuration.md names settings that do not exist"


def test_every_command_is_in_the_cli_page_and_only_commands_are() -> None:
    real = set(commands(typer.main.get_command(app)))
    documented = documented_commands()
    assert real - documented == set(), "commands missing from docs/cli.md"
    groups = {name.split()[0] for name in real}
    gone = {name for name in documented if name not in real and name not in groups}
    assert gone == set(), "docs/cli.md documents commands that do not exist"


def test_every_relative_link_leads_to_a_file() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []
