"""Speech synthesis behind one interface (`BRIDGE_TTS_*`).

`synthesize` yields PCM16 mono chunks at the requested rate as soon as they exist, so the first
frame of a sentence goes out before the sentence is fully synthesized.
"""

from collections.abc import AsyncIterator
from typing import Protocol


class Synthesizer(Protocol):
    name: str

    def synthesize(self, text: str, language: str, sample_rate: int) -> AsyncIterator[bytes]:
        """PCM16 chunks (any size) of `text` spoken in `language` ("vi", "en")."""

    async def aclose(self) -> None: ...
