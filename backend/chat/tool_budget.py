"""The functions a turn offers the model, within a budget.

A device declares up to 2,000 tools and an external server up to its own bounds; sending them
all on every turn cost a dialed-in server's neighbours 48.7 MB and 503 functions per turn (issue
#32). A turn offers at most `max_tools` functions and `max_bytes` of their declarations (name,
description and the JSON of the input schema). When all of them fit, all are offered, in their
order. When they do not, the ones whose name and description share the most words with the
request are chosen first (ties in their order), as many as fit, and offered in their order.
"""

import json
import re
from collections.abc import Sequence

from backend.chat.llm.base import FunctionSpec
from backend.chat.text import folded_words, wordset

MAX_TOOLS_PER_TURN = 32
MAX_TOOL_BYTES_PER_TURN = 64 * 1024

_SPLIT = re.compile(r"[^a-z0-9]+")
_COMMON = wordset(
    "the a an to of and or in on for with is are it this that my me you your get set what how "
    "please can could would should do does self tool"
)


def declared_bytes(spec: FunctionSpec) -> int:
    """What one function's declaration costs in a request to the model."""
    schema = json.dumps(spec.parameters, separators=(",", ":"), ensure_ascii=False)
    return len(spec.llm_name) + len(spec.description.encode()) + len(schema.encode())


def within_budget(
    functions: Sequence[FunctionSpec],
    request: str,
    *,
    max_tools: int = MAX_TOOLS_PER_TURN,
    max_bytes: int = MAX_TOOL_BYTES_PER_TURN,
) -> list[FunctionSpec]:
    """The functions to offer for `request` (see the module docstring)."""
    sizes = [declared_bytes(spec) for spec in functions]
    if len(functions) <= max_tools and sum(sizes) <= max_bytes:
        return list(functions)
    asked = {word for word in folded_words(request) if word not in _COMMON}
    scores = [len(asked & _words(spec)) for spec in functions]
    order = sorted(range(len(functions)), key=lambda index: (-scores[index], index))
    chosen: list[int] = []
    spent = 0
    for index in order:
        if len(chosen) == max_tools:
            break
        if spent + sizes[index] > max_bytes:
            continue  # a smaller one may still fit
        chosen.append(index)
        spent += sizes[index]
    return [functions[index] for index in sorted(chosen)]


def _words(spec: FunctionSpec) -> set[str]:
    text = f"{spec.llm_name} {spec.description}".lower()
    return {word for word in _SPLIT.split(text) if word and word not in _COMMON}
