"""The device dialogue: what a device says (typed or recognized) becomes a chat turn, answered
on that device in text or in speech (`DeviceChat`). Below the voice path: voice hands it what
it heard and gives it a spoken `Answer` for each turn; without voice, answers are text."""

from backend.dialogue.device_chat import Answer, DeviceChat, TextAnswer
from backend.dialogue.timings import TurnTimings

__all__ = ["Answer", "DeviceChat", "TextAnswer", "TurnTimings"]
