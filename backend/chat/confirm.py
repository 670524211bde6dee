"""Risky device tools in a chat: ask first, call only after a "yes" in the next turn.

When a turn wants a tool that needs confirmation (reboot, upgrade, settings: the device
registry refuses it unconfirmed), the turn does not call it; it asks the user and remembers the
call here, for the conversation (and the device, for a front end that names only the device).
The next turn of that conversation:

- is yes/ok/sure/có/vâng/đồng ý... (the whole reply, fillers aside) → the remembered call
  runs, confirmed, and the turn says how it went (nothing else happens in that turn);
- is no/cancel/không/hủy... → it is dropped and the turn says so;
- anything else (a question that starts with "có", "ok but...") → it is dropped and the turn
  goes on as usual.

A question expires after `ttl_s` (5 minutes) and at most `limit` are kept (oldest go first).
"""

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from backend.chat.text import Language
from backend.common import Lru

# A reply is an answer only when every word of it is a yes (or a no) word or a filler: "Có nên
# dùng nước súc miệng không?" starts with "có" but asks a question, and "ok but first tell me
# about floss" is not a go-ahead. Vietnamese is matched with and without accents.
_YES = {
    "yes", "y", "yeah", "yep", "ok", "okay", "sure", "confirm", "confirmed",
    "có", "co", "vâng", "vang", "ừ", "được", "duoc", "đồng", "dong", "ý", "xác", "xac", "nhận",
    "nhan",
}  # fmt: skip
_NO = {
    "no", "n", "nope", "cancel", "stop", "don't", "dont", "không", "khong", "hủy", "huy", "bỏ",
    "bo", "thôi", "thoi", "đừng", "dung",
}  # fmt: skip
_FILLER = {
    "please", "thanks", "thank", "you", "go", "ahead", "do", "it", "that", "this", "now",
    "ạ", "a", "nhé", "nhe", "nha", "đi", "di", "luôn", "luon", "làm", "lam", "cần",
}  # fmt: skip
_MAX_ANSWER_WORDS = 6
_WORD = re.compile(r"[\w']+", re.UNICODE)

QUESTION = {
    "en": 'This needs your confirmation: {tool} {arguments} ({reason}). Reply "yes" to go ahead; '
    "anything else cancels it.",
    "vi": 'Thao tác này cần bạn xác nhận: {tool} {arguments} ({reason}). Trả lời "có" để tiếp '
    "tục; câu trả lời khác sẽ hủy.",
}
# A change asked back because the recognizer was not sure of the words (chat.tools.UNSURE_REASON):
# a short spoken question naming the change, not the tool's name and JSON arguments.
HEARD_QUESTION = {
    "en": "Did you want me to {action}? Please say yes or no.",
    "vi": "Bạn muốn tôi {action} phải không? Hãy nói có hoặc không.",
}
UNSURE_REASON = "not sure I heard that right"
_ACTION_VERBS = frozenset(
    [
        *("set", "turn", "switch", "change", "make", "put", "play", "stop", "start", "open"),
        *("close", "reboot", "restart", "toggle"),
    ]
)
CANCELLED = {"en": "OK, I did not run {tool}.", "vi": "Được, tôi đã không chạy {tool}."}
# ... as a voice says it: the change in words, not the tool's name (`spoken_action`).
CANCELLED_SPOKEN = {"en": "OK, I did not {action}.", "vi": "Được, tôi đã hủy thao tác đó."}
DONE = {"en": "Done: {tool} → {result}", "vi": "Đã xong: {tool} → {result}"}
# The device's own error goes to the front end in the mcp_tool error event, never into speech.
FAILED = {
    "en": "Sorry, {tool} did not work: the device reported an error.",
    "vi": "Xin lỗi, {tool} không thực hiện được: thiết bị báo lỗi.",
}


@dataclass(frozen=True, slots=True)
class PendingConfirmation:
    """A tool call held back until the user says yes: which tool, with what, and why."""

    device_id: str | None
    tool: str  # the device's MCP name
    llm_name: str
    arguments: dict[str, Any]
    reason: str
    asked_at: float


def answer_kind(text: str) -> Literal["yes", "no", "other"]:
    """Whether a reply is a yes, a no, or anything else (a question, a new request)."""
    words = _WORD.findall(text.lower())
    if not words or len(words) > _MAX_ANSWER_WORDS:
        return "other"
    yes = sum(word in _YES for word in words)
    no = sum(word in _NO for word in words)
    if yes + no + sum(word in _FILLER for word in words) != len(words):
        return "other"
    if yes and not no:
        return "yes"
    if no and not yes:
        return "no"
    return "other"


def question(language: Language, pending: PendingConfirmation, arguments_text: str) -> str:
    """The question asking the user to confirm this call, in their language."""
    if pending.reason == UNSURE_REASON:
        action = spoken_action(pending.tool, pending.arguments)
        if language == "vi":
            action = f"thực hiện {action}"
        return HEARD_QUESTION[language].format(action=action)
    return QUESTION[language].format(
        tool=pending.tool, arguments=arguments_text, reason=pending.reason
    )


def spoken_action(tool: str, arguments: dict[str, Any]) -> str:
    """A tool call as words: ("self.screen.set_brightness", {"brightness": 3}) -> "set the
    screen brightness to 3"; ("self.led.set", {"on": True}) -> "set the LED on"."""
    parts = [p for p in tool.split(".") if p and p != "self"]
    words = [w for p in parts for w in p.lower().split("_") if w and w != "audio"]
    verb = next((w for w in words if w in _ACTION_VERBS), None)
    things = [w for w in words if w != verb]
    said = [verb or "use"]
    if things:
        said += ["the", *(w.upper() if len(w) <= 3 else w for w in things)]
    rest = []
    for name, value in arguments.items():
        if isinstance(value, bool):
            rest.append("on" if value else "off")
        elif name.lower() in things and not rest:
            rest.append(f"to {value}")
        else:
            rest.append(f"with {name.replace('_', ' ')} {value}")
    return " ".join(said + rest)


class ConfirmationBook:
    """Remembered questions by conversation id (and `device:<id>`)."""

    def __init__(
        self, *, ttl_s: float = 300.0, limit: int = 1000, clock: Callable[[], float] = time.time
    ) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._clock = clock
        self._pending: Lru[str, PendingConfirmation] = Lru(limit)

    def remember(self, keys: list[str], pending: PendingConfirmation) -> None:
        """Remember the call under each key (replacing older ones); past `limit` the oldest go."""
        for key in keys:
            self._pending.put(key, pending)

    def take(self, keys: list[str]) -> PendingConfirmation | None:
        """The question asked in one of these conversations (removed), if still fresh."""
        found: PendingConfirmation | None = None
        for key in keys:
            pending = self._pending.pop(key, None)
            if pending is not None and found is None:
                found = pending
        if found is not None:
            for key in [k for k, v in self._pending.items() if v is found]:
                del self._pending[key]
        if found is None or self._clock() - found.asked_at > self.ttl_s:
            return None
        return found

    def __len__(self) -> int:
        return len(self._pending)
