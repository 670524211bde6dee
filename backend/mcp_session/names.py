"""Device tool names <-> LLM function names.

LLM APIs (OpenAI and compatibles) accept function names matching `^[a-zA-Z0-9_-]{1,64}$`, while
device tools are called `self.audio_speaker.set_volume` or even carry CJK characters. The mapping
here is deterministic and depends only on the set of names (never on their order), reversible and
collision-free:

1. A name that is already valid maps to itself.
2. Otherwise every character outside `[A-Za-z0-9_-]` becomes `_`
   (`self.audio_speaker.set_volume` -> `self_audio_speaker_set_volume`).
3. If that result is too long, collides with any other name's result (including names valid as
   they are), or the original has no ASCII letter or digit (empty, CJK-only...), the name gets
   `_` + the first 8 hex digits of the SHA-256 of the original, with the stem cut so the whole is
   at most 64 characters. The hash grows, then a counter is added, in the (constructed) case
   where even that is taken.
"""

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from itertools import count
from typing import Any

from backend.errors import BridgeError
from backend.mcp_session.models import Tool

MAX_LLM_NAME_LENGTH = 64
_LLM_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9_-]")
_ASCII_ALNUM = re.compile(r"[A-Za-z0-9]")
_HASH_LENGTHS = (8, 12, 16, 24, 32)
_FALLBACK_STEM = "tool"
# A mention of a tool name in prose must not be part of a longer identifier.
_BEFORE = r"(?<![A-Za-z0-9_.-])"
_AFTER = r"(?![A-Za-z0-9_-]|\.[A-Za-z0-9_])"  # a final "." ends a sentence


class UnknownToolName(BridgeError):
    """The name is not in this map."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown tool name {name!r}")
        self.name = name


def is_llm_name(name: str) -> bool:
    """Whether a name is usable as a function name by LLM APIs as it is."""
    return _LLM_NAME.fullmatch(name) is not None


class ToolNameMap:
    """A reversible mapping between device tool names and LLM function names."""

    __slots__ = ("_from_llm", "_to_llm")

    def __init__(self, names: Iterable[str]) -> None:
        unique = set(names)
        for name in unique:
            if not isinstance(name, str):
                raise TypeError(f"tool names must be strings, not {type(name).__name__}")
        self._to_llm = _assign(sorted(unique))
        self._from_llm = {llm: name for name, llm in self._to_llm.items()}

    def to_llm(self, name: str) -> str:
        """The LLM-safe name of an MCP tool name; raises UnknownToolName."""
        try:
            return self._to_llm[name]
        except KeyError:
            raise UnknownToolName(name) from None

    def from_llm(self, llm_name: str) -> str:
        """The MCP tool name behind an LLM-safe name; raises UnknownToolName."""
        try:
            return self._from_llm[llm_name]
        except KeyError:
            raise UnknownToolName(llm_name) from None

    def items(self) -> Iterator[tuple[str, str]]:
        """(device name, LLM name) pairs, sorted by device name."""
        return iter(sorted(self._to_llm.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._to_llm

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._to_llm))

    def __len__(self) -> int:
        return len(self._to_llm)

    def __repr__(self) -> str:
        return f"ToolNameMap({dict(self.items())!r})"


def llm_functions(
    tools: Iterable[Tool], name_map: ToolNameMap | None = None
) -> list[dict[str, Any]]:
    """LLM function declarations for `tools`; descriptions refer to tools by their LLM names.

    `parameters` is the tool's inputSchema, whole and unchanged. Pass the `name_map` you will
    use to map the model's calls back; it must contain every tool (UnknownToolName otherwise).
    """
    tools = list(tools)
    names = name_map if name_map is not None else ToolNameMap(tool.name for tool in tools)
    rewrite = _mention_rewriter(names)
    functions: list[dict[str, Any]] = []
    emitted: set[str] = set()
    for tool in tools:
        if tool.name in emitted:
            continue
        emitted.add(tool.name)
        functions.append(
            {
                "name": names.to_llm(tool.name),
                "description": rewrite(tool.description),
                "parameters": tool.input_schema,
            }
        )
    return functions


def _assign(names: list[str]) -> dict[str, str]:
    """The mapping for sorted, unique `names` (sorting makes it independent of input order)."""
    mapping = {name: name for name in names if is_llm_name(name)}
    others = [name for name in names if name not in mapping]
    candidates = {name: _plain_candidate(name) for name in others}
    uses = Counter(candidate for candidate in candidates.values() if candidate is not None)
    needs_hash: list[str] = []
    for name in others:
        candidate = candidates[name]
        if candidate is not None and uses[candidate] == 1 and candidate not in mapping:
            mapping[name] = candidate
        else:
            needs_hash.append(name)
    taken = set(mapping.values())
    for name in needs_hash:
        llm_name = _hashed(name, taken)
        mapping[name] = llm_name
        taken.add(llm_name)
    return mapping


def _plain_candidate(name: str) -> str | None:
    """The name with unsafe characters replaced, when that is usable without a hash."""
    if _ASCII_ALNUM.search(name) is None:
        return None
    candidate = _UNSAFE_CHAR.sub("_", name)
    return candidate if len(candidate) <= MAX_LLM_NAME_LENGTH else None


def _hashed(name: str, taken: set[str]) -> str:
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    stem = _UNSAFE_CHAR.sub("_", name) if _ASCII_ALNUM.search(name) else _FALLBACK_STEM
    for length in _HASH_LENGTHS:
        llm_name = f"{stem[: MAX_LLM_NAME_LENGTH - 1 - length]}_{digest[:length]}"
        if llm_name not in taken:
            return llm_name
    for number in count(1):  # only reachable when someone built names to collide on purpose
        suffix = f"_{digest[:8]}_{number}"
        llm_name = stem[: MAX_LLM_NAME_LENGTH - len(suffix)] + suffix
        if llm_name not in taken:
            return llm_name
    raise AssertionError("unreachable")


def _mention_rewriter(names: ToolNameMap) -> Callable[[str], str]:
    """A function replacing mentions of renamed tools in text, longest names first."""
    renamed = {
        name: llm
        for name, llm in names.items()
        if name != llm and any(char.isalnum() for char in name)
    }
    if not renamed:
        return lambda text: text
    alternatives = sorted(renamed, key=lambda name: (-len(name), name))
    pattern = re.compile(_BEFORE + "(?:" + "|".join(map(re.escape, alternatives)) + ")" + _AFTER)
    return lambda text: pattern.sub(lambda match: renamed[match.group(0)], text)
