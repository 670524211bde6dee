"""Readable `--help`: metavars instead of Python type names, prose that wraps as prose.

Recent Typer releases show each parameter's Python type in the help (`<bool>`, `<list[str]>`,
`<int range> [x>=1]`) and a required argument as `{device}` in the usage line; `tidy_help`
rewraps docstrings. `apply()` adjusts the first, where this Typer has it (older releases print
click's TEXT/INTEGER and need nothing):

- an option shows its metavar (PORT, N, FILE: every option of this CLI names one), a flag shows
  nothing, an option without a metavar its kind in capitals (TEXT, INTEGER, PATH);
- an argument shows only its name (its metavar, DEVICE), required ones bare in the usage line,
  optional ones in brackets;
- a number's range is said in the option's help where it matters, not as `[x>=1]`.
"""

import inspect
from typing import Any

import typer

_KINDS = {"int": "INTEGER", "float": "NUMBER", "bool": "BOOLEAN", "str": "TEXT"}


def _option_type(self: Any, ctx: Any = None) -> str | None:
    if self.metavar is not None:
        return str(self.metavar) or None
    if getattr(self, "is_flag", False) or getattr(self, "count", False):
        return None
    descriptor = getattr(self, "type_descriptor", None)
    if descriptor is not None and getattr(descriptor, "is_path", False):
        return "PATH"
    bare = self.bare_type() if hasattr(self, "bare_type") else "str"
    bare = bare.removeprefix("list[").removesuffix("]")
    return _KINDS.get(bare, "VALUE")


def _argument_type(self: Any, ctx: Any = None) -> None:
    return None


def _no_range(_self: Any) -> None:
    return None


def _argument_usage(self: Any) -> str:
    name = str(self.metavar or self.name.upper())
    if not self.required:
        name = f"[{name}]"
    return name + ("..." if self.nargs != 1 else "")


def apply() -> None:
    """Patch this Typer's parameter display, where it has the methods this module replaces."""
    from typer import core

    option = getattr(core, "TyperOption", None)
    argument = getattr(core, "TyperArgument", None)
    if option is None or argument is None:
        return
    if hasattr(option, "display_type_rich"):
        option.display_type_rich = _option_type
    if hasattr(argument, "display_type_rich"):
        argument.display_type_rich = _argument_type
    for cls in (option, argument):
        if hasattr(cls, "_get_number_range_help_str"):
            cls._get_number_range_help_str = _no_range
    if hasattr(argument, "_usage_display_name"):
        argument._usage_display_name = _argument_usage


def tidy_help(text: str | None) -> str | None:
    """A docstring as help: each paragraph's lines joined (the terminal wraps them), list items
    (`- ...`) kept on their own lines."""
    if not text:
        return text
    paragraphs = []
    for paragraph in inspect.cleandoc(text).split("\n\n"):
        lines = paragraph.splitlines()
        if lines and all(line.startswith("- ") or line.startswith("  ") for line in lines):
            paragraphs.append(paragraph)  # a list: Typer keeps its lines
            continue
        paragraphs.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(paragraphs)


def tidy_app(app: typer.Typer) -> None:
    """Give every command and group of `app` (recursively) its docstring as tidied help."""
    for command in app.registered_commands:
        if command.help is None and command.callback is not None:
            command.help = tidy_help(inspect.getdoc(command.callback))
    for group in app.registered_groups:
        if group.typer_instance is not None:
            tidy_app(group.typer_instance)
    info = app.registered_callback
    if info is not None and info.help is None and info.callback is not None:
        info.help = tidy_help(inspect.getdoc(info.callback))
