"""The embedded Vietnamese recognizer: `viet-asr` (the `voice-vi` extra), in a decoding process.

`viet-asr` (import `vietasr`) ships an int8 streaming Conformer-CTC model inside its native
library and runs with no network. The package is Apache-2.0; **the origin and license of its
weights are not stated** (docs/voice.md says what is known). It reports no confidence, and on
synthetic Vietnamese speech its word error rate is high (0.78 measured on eSpeak NG), so every
transcript it gives is *unsure*: the assistant answers questions, and asks before it changes
anything on the device.
"""

import atexit
import time
from typing import Any

from backend.chat.text import fold
from backend.voice.recognition import RecognitionHints, Transcript
from backend.voice.recognition.pool import Decoded, DecodePool, EngineSpec

ENGINE = "viet-asr"
PAD_S = 0.5  # silence on each side: without it the model drops the first syllables
RATE = 16000


class VietnameseEngine:
    """The model, loaded once in the decoding process."""

    def __init__(self) -> None:
        import numpy as np
        import vietasr
        from vietasr.ffi import native

        native.lib.vietasr_set_log_level(3)  # its INFO lines went to stderr for every call
        self._np = np
        self._pipeline: Any = vietasr.Pipeline.new().add("vietasr").build()
        atexit.register(self._pipeline.close)  # before cffi is torn down at exit

    def decode(self, pcm: bytes, prompt: str) -> Decoded:
        """The text of one utterance of 16 kHz PCM16 (the prompt is not used)."""
        np = self._np
        began = time.process_time()
        pad = np.zeros(int(PAD_S * RATE), dtype=np.int16)
        audio = np.concatenate([pad, np.frombuffer(pcm, dtype="<i2"), pad])
        text = self._pipeline.transcribe(audio, RATE).text
        return Decoded(str(text).strip(), cpu_s=time.process_time() - began)


def load() -> VietnameseEngine:
    """The decoding process's engine (`pool.EngineSpec` names this function)."""
    return VietnameseEngine()


class VietnameseRecognizer:
    """Vietnamese speech, recognized by `viet-asr` in a `DecodePool` process."""

    name = ENGINE

    def __init__(self, *, queue_max: int = 8, preload: bool = False) -> None:
        spec = EngineSpec("backend.voice.recognition.vietnamese:load", (), ENGINE)
        self.pool = DecodePool(spec, workers=1, queue_max=queue_max)
        self.preload = preload

    async def start(self) -> None:
        """Start the decoding process when the bridge's own language is Vietnamese; otherwise
        at the first Vietnamese utterance (it then waits about a second for the model)."""
        if self.preload:
            self.pool.start()

    def backlog_s(self) -> float:
        """About how long a new utterance would wait."""
        return self.pool.backlog_s()

    async def recognize(self, pcm: bytes, hints: RecognitionHints) -> Transcript:
        """The text of one utterance; raises RecognizerBusy or RecognitionFailed."""
        decoded = await self.pool.decode(pcm, "")
        # Its commonest slip is a tone mark ("âm lương" for "âm lượng"): the text without its
        # marks is offered as another reading, which the router reads only when the marked
        # one asks nothing of the device (voice/understanding.py; unsure, so asked back).
        plain = fold(decoded.text)
        others = (plain,) if plain and plain != decoded.text.lower() else ()
        return Transcript(decoded.text, ENGINE, "vi", sure=False, alternatives=others)

    async def aclose(self) -> None:
        """Stop the decoding process."""
        await self.pool.aclose()
