"""Which device tools need an explicit confirmation before they run.

Tools that reboot a device, upgrade it or change its persistent settings are risky: a model
that misread a sentence, or a script with the wrong device id, should not do that silently.
`Device.call_tool` refuses them with `ConfirmationRequired` unless the caller says
`confirmed=True` (the admin API's `"confirm": true`, the CLI's `--confirm`, a "yes" in the next
chat turn).

Rules (setting `confirm_tools`) are `fnmatch` patterns matched against the tool name, or
`DEVICE/TOOL` pairs for one device (or a pattern of devices); a leading `!` exempts. Patterns
and names are both compared normalized: NFKC, format and control characters (zero-width space,
joiners, BOM, soft hyphen) and whitespace removed, case-folded. So `self.REBOOT`,
`self.reboot\u200b` and a full-width `ｓｅｌｆ.reboot` are the same tool as `self.reboot` to the
rules; a device cannot dodge a rule by spelling. The last rule that matches decides. When none
matches, a tool whose MCP annotations say `destructiveHint: true` needs confirmation (setting
`confirm_destructive_hint`).
"""

import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from backend.config import DEFAULT_CONFIRM_TOOLS
from backend.mcp_session import Tool

_CACHE_LIMIT = 65536


@dataclass(frozen=True, slots=True)
class _Rule:
    text: str
    device: str
    tool: str
    confirm: bool

    def matches(self, device_id: str, tool: str) -> bool:
        """Both arguments normalized already (`normalized_name`)."""
        return fnmatchcase(tool, self.tool) and fnmatchcase(device_id, self.device)


def normalized_name(name: str) -> str:
    """A name as the rules compare it: NFKC, no format (Cf), control (Cc), unassigned or
    surrogate characters, no whitespace, case-folded (then NFKC again: folding can denormalize)."""
    text = unicodedata.normalize("NFKC", name)
    kept = "".join(
        char for char in text if unicodedata.category(char) not in _DROPPED and not char.isspace()
    )
    return unicodedata.normalize("NFKC", kept.casefold())


_DROPPED = frozenset({"Cf", "Cc", "Cs", "Cn"})


def parse_rule(text: str) -> _Rule:
    """Parse one `confirm_tools` rule (`[!][DEVICE/]TOOL`); raises ValueError on an empty tool
    pattern."""
    raw = text.strip()
    confirm = not raw.startswith("!")
    body = raw[1:].strip() if not confirm else raw
    device, sep, tool = body.rpartition("/")
    if not sep:
        device = "*"
    if not tool:
        raise ValueError(f"empty tool pattern in confirmation rule {text!r}")
    return _Rule(raw, normalized_name(device or "*"), normalized_name(tool), confirm)


class ConfirmationPolicy:
    """Decides which tool calls need `confirmed=True`: the rules, then the destructive hint."""

    def __init__(
        self, rules: Iterable[str] = DEFAULT_CONFIRM_TOOLS, *, destructive_hint: bool = True
    ) -> None:
        self.rules = tuple(parse_rule(rule) for rule in rules)
        self.destructive_hint = destructive_hint
        self._cache: dict[tuple[str, str, bool], str | None] = {}

    def reason(self, device_id: str, tool: Tool) -> str | None:
        """Why `tool` on `device_id` needs a confirmation, or None when it does not."""
        destructive = (tool.annotations or {}).get("destructiveHint") is True
        key = (device_id, tool.name, destructive)
        try:
            return self._cache[key]
        except KeyError:
            pass
        decided = self._decide(normalized_name(device_id), normalized_name(tool.name), destructive)
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = decided
        return decided

    def _decide(self, device_id: str, name: str, destructive: bool) -> str | None:
        matched: _Rule | None = None
        for rule in self.rules:
            if rule.matches(device_id, name):
                matched = rule
        if matched is not None:
            return f"rule {matched.text!r}" if matched.confirm else None
        if self.destructive_hint and destructive:
            return "the tool is marked destructiveHint"
        return None
