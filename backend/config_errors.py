"""Where a bad setting came from and what it should be: one line per configuration error
naming the file and line, the `BRIDGE_*` variable or the command line, with the closest setting
or allowed value; and the `BRIDGE_*` variables no setting reads (typos). Works on any pydantic
settings model (`backend.config.Settings` passes itself), so it imports nothing of the bridge.
"""

import difflib
import enum
import json
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic_settings import SettingsError

# `BRIDGE_*` variables read outside Settings: the config file itself and the CLI's own (options'
# `envvar`s included). Any other `BRIDGE_*` variable is a typo: the CLI warns about it.
# tests/test_config_errors.py fails when the source names a variable that is in neither.
OTHER_VARIABLES = frozenset(
    {
        "BRIDGE_CONFIG",  # load_settings: the TOML file
        "BRIDGE_SERVER",  # backend/cli/local.py: the admin API URL of the bridge to talk to
        "BRIDGE_API_KEY",  # backend/cli/chat.py: the chat's API key
        "BRIDGE_SIMULATE_OTA",  # `simulate --ota`
    }
)
ENV_PREFIX = "BRIDGE_"


def setting_variable(field: str) -> str:
    """The environment variable of a setting: `ws_port` -> `BRIDGE_WS_PORT`."""
    return f"{ENV_PREFIX}{field.upper()}"


def unknown_variables(
    model: type[BaseModel], environ: Mapping[str, str] | None = None
) -> list[str]:
    """One line per `BRIDGE_*` variable in `environ` that no setting and no command reads (a
    typo), with the closest known name: `... is not a known variable (ignored); did you mean
    BRIDGE_WS_PORT?` (names are compared without case, as the settings read them)."""
    environ = os.environ if environ is None else environ
    known = {setting_variable(field) for field in model.model_fields}
    known |= OTHER_VARIABLES
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if upper.startswith(ENV_PREFIX) and upper not in known:
            hint = closest(upper, known)
            lines.append(
                f"{name} is not a known variable (ignored)"
                + (f"; did you mean {hint}?" if hint else "")
            )
    return lines


_warned_variables: set[str] = set()


def warn_unknown_variables(model: type[BaseModel], emit: Callable[[str], None]) -> None:
    """`emit` each unknown `BRIDGE_*` variable's line once per process."""
    for line in unknown_variables(model):
        if line not in _warned_variables:
            _warned_variables.add(line)
            emit(line)


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like `word` (for "did you mean"), None when none is close."""
    found = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def explain(
    exc: ValidationError, model: type[BaseModel], path: Path | str | None, given: dict[str, Any]
) -> str:
    """The first error (in file order), one line: where it is, what is wrong, what would do."""
    text = _read_text(path)
    lines = toml_key_lines(text) if text is not None else {}
    environ = {name.upper(): name for name in os.environ}
    explained = [
        _explain_one(error, model, path, given, lines, environ)
        for error in exc.errors(include_url=False)
    ]
    explained.sort(key=lambda item: item[0])
    message = explained[0][1]
    if len(explained) > 1:
        message += f" (and {len(explained) - 1} more)"
    return message


def _explain_one(
    error: Any,
    model: type[BaseModel],
    path: Path | str | None,
    given: dict[str, Any],
    lines: dict[tuple[str | int, ...], int],
    environ: dict[str, str],
) -> tuple[tuple[int, int], str]:
    loc = tuple(part for part in error["loc"] if part != "[key]")
    message = str(error["msg"]).removeprefix("Value error, ")
    field = loc[0] if loc and isinstance(loc[0], str) else None
    if field is None:  # a check across settings: point at the first setting it names
        field = next(
            (
                name
                for name in _named_fields(model, message)
                if name in given or setting_variable(name) in environ or (name,) in lines
            ),
            None,
        )
        loc = (field,) if field else ()
        what = f"invalid settings: {message}"
    elif error["type"] == "extra_forbidden":
        what = _unknown_key(model, loc)
    else:
        allowed = _allowed_values(model, loc, error)
        where = _dotted(loc)
        if allowed is not None:
            value = str(error.get("input"))
            what = f'invalid setting {where!r}: "{value}" is not one of: {", ".join(allowed)}'
            hint = closest(value, allowed)
            what += f'; did you mean "{hint}"?' if hint else ""
        else:
            what = f"invalid setting {where!r}: {message}"
    if field is not None and field in given:
        return (0, 0), f"command line: {what}"
    if field in model.model_fields and setting_variable(field) in environ:
        return (1, 0), f"environment variable {environ[setting_variable(field)]}: {what}"
    line = _line_of(loc, lines)
    if path is not None and line is not None:
        return (2, line), f"{path}, line {line}: {what}"
    if path is not None:
        return (3, 0), f"{path}: {what}"
    return (3, 0), what


def explain_source_error(exc: SettingsError) -> str:
    """pydantic-settings' `error parsing value for field "x" from source "EnvSettingsSource"`:
    the variable, and why."""
    found = re.search(r'field "([^"]+)" from source "(\w+)"', str(exc))
    cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
    if found is None:
        return f"invalid settings: {exc}{cause}"
    field, source = found.groups()
    if source == "EnvSettingsSource":
        variable = next(
            (name for name in os.environ if name.upper() == setting_variable(field)),
            setting_variable(field),
        )
        return f"environment variable {variable}: invalid setting {field!r}: not valid JSON{cause}"
    return f"invalid setting {field!r} ({source}){cause}"


def _read_text(path: Path | str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _dotted(loc: tuple[str | int, ...]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")


def _named_fields(model: type[BaseModel], message: str) -> list[str]:
    """The settings a cross-setting check's message names, in the order it names them."""
    words = re.findall(r"[a-z][a-z0-9_]*", message)
    return [word for word in dict.fromkeys(words) if word in model.model_fields]


def _unknown_key(model: type[BaseModel], loc: tuple[str | int, ...]) -> str:
    key = str(loc[-1])
    holder = _annotation_at(model, loc[:-1])
    names = list(holder.model_fields) if _is_model(holder) else []
    where = _dotted(loc[:-1])
    what = f'unknown setting "{key}"' if not where else f'unknown key "{key}" in {where}'
    hint = closest(key, names)
    return what + (f'; did you mean "{hint}"?' if hint else "")


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _unwrapped(annotation: Any) -> list[Any]:
    """The types an annotation may hold: Optional, unions and Annotated opened up."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrapped(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [kind for arg in typing.get_args(annotation) for kind in _unwrapped(arg)]
    return [annotation]


def _annotation_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> Any:
    """The type at an error location within `model` (None when it cannot be followed)."""
    current: Any = model
    for part in loc:
        following = None
        for kind in _unwrapped(current):
            origin = typing.get_origin(kind)
            if _is_model(kind) and isinstance(part, str) and part in kind.model_fields:
                following = kind.model_fields[part].annotation
            elif origin in (list, tuple, set, frozenset) and isinstance(part, int):
                following = typing.get_args(kind)[0]
            elif origin is dict and isinstance(part, str):
                following = typing.get_args(kind)[1]
            if following is not None:
                break
        if following is None:
            return None
        current = following
    return current


def _allowed_values(
    model: type[BaseModel], loc: tuple[str | int, ...], error: Any
) -> list[str] | None:
    """The values a field with a fixed set takes (Literal, Enum, or a `^(a|b|c)$` pattern)."""
    if error["type"] == "string_pattern_mismatch":
        pattern = str(error.get("ctx", {}).get("pattern", ""))
        found = re.fullmatch(r"\^\(([\w\-|]+)\)\$", pattern)
        return found.group(1).split("|") if found else None
    if error["type"] not in ("literal_error", "enum"):
        return None
    for kind in _unwrapped(_annotation_at(model, loc)):
        if typing.get_origin(kind) is Literal:
            return [str(value) for value in typing.get_args(kind)]
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return [str(member.value) for member in kind]
    return None


def _line_of(loc: tuple[str | int, ...], lines: dict[tuple[str | int, ...], int]) -> int | None:
    """The line of `loc` in the file: its own key, else the key or table holding it (an inline
    table or an array), else the first key under it."""
    for size in range(len(loc), 0, -1):
        if loc[:size] in lines:
            return lines[loc[:size]]
    below = [line for key, line in lines.items() if loc and key[: len(loc)] == loc]
    return min(below) if below else None


_BARE_KEY = r"[A-Za-z0-9_\-]+"
_KEY_PART = rf"(?:{_BARE_KEY}|\"(?:[^\"\\]|\\.)*\"|'[^']*')"
_KEY = rf"{_KEY_PART}(?:\s*\.\s*{_KEY_PART})*"
_TABLE = re.compile(rf"^\s*(\[\[?)\s*({_KEY})\s*\]\]?")
_ASSIGNMENT = re.compile(rf"^\s*({_KEY})\s*=")


def _key_parts(key: str) -> list[str]:
    parts = re.findall(_KEY_PART, key)
    return [json.loads(part) if part.startswith('"') else part.strip("'") for part in parts]


def toml_key_lines(text: str) -> dict[tuple[str | int, ...], int]:
    """Every key and table of a TOML text → its line (1-based), as pydantic locations: tables
    of arrays (`[[mcp_servers]]`) count their entries, `("mcp_servers", 1, "name")`. tomllib
    gives no positions: keys are found at the start of a line, within their table."""
    lines: dict[tuple[str | int, ...], int] = {}
    arrays: dict[tuple[str | int, ...], int] = {}  # a table array's path → its entries so far
    table: tuple[str | int, ...] = ()
    in_string = None  # the quote of a multi-line string being read
    for number, line in enumerate(text.splitlines(), start=1):
        if in_string is not None:
            if line.count(in_string) % 2:
                in_string = None
            continue
        header = _TABLE.match(line)
        if header:
            parts = _key_parts(header.group(2))
            if header.group(1) == "[[":  # a new entry of a table array
                path = (*_resolved(parts[:-1], arrays), parts[-1])
                arrays[path] = arrays.get(path, 0) + 1
                path = (*path, arrays[path] - 1)
            else:
                path = _resolved(parts, arrays)
            table = path
            lines.setdefault(table, number)
            continue
        assignment = _ASSIGNMENT.match(line)
        if assignment:
            key = (*table, *_key_parts(assignment.group(1)))
            lines.setdefault(key, number)
            for quote in ('"""', "'''"):
                if line.count(quote) % 2:
                    in_string = quote
    return lines


def _resolved(parts: list[str], arrays: dict[tuple[str | int, ...], int]) -> tuple[str | int, ...]:
    """A table header's path, each table array it passes through at its last entry."""
    path: tuple[str | int, ...] = ()
    for part in parts:
        path = (*path, part)
        if path in arrays:
            path = (*path, arrays[path] - 1)
    return path
