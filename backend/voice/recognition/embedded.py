"""The embedded English recognizer: Whisper tiny.en in the decoding processes.

Each utterance is decoded whole, with the device's prompt (`vocabulary.prompt_for`), and
comes back with the model's own doubt: a transcript is *unsure* when its tokens' mean
log-probability is below `UNSURE_LOGPROB` or the model thinks the window held no speech, and
with the beam's other readings (`Transcript.alternatives`), which `voice/understanding.py`
weighs. An unsure transcript is still answered, but the assistant asks before it changes the
device.
"""

import math
import re

from backend.voice.recognition import RecognitionHints, Transcript
from backend.voice.recognition.pool import Decoded, DecodePool, EngineSpec
from backend.voice.recognition.vocabulary import normalized
from backend.voice.recognition.whisper import model_dir

ENGINE = "whisper-tiny.en"
# Measured on the recognition set (bench/voice_recognition.py): commands heard right had a mean
# token log-probability of -0.05 to -0.45 (median -0.17); wrong ones -0.15 to -1.1 (median -0.5).
# Below it a reading is unsure unless the beam's other readings agree (voice/understanding.py).
UNSURE_LOGPROB = -0.45
NO_SPEECH = 0.6  # Whisper's no-speech probability above which the text is likely invented
# Whisper's habitual inventions on silence and noise (its training subtitles).
_HALLUCINATIONS = frozenset(
    [
        "thank you",
        "thank you for watching",
        "thanks for watching",
        "thank you very much for watching",
        "you",
        "bye",
    ]
)
LOOP_REPEATS = 3
_CLAUSE = re.compile(r"[^,.!?;]+[,.!?;]?")


def _plain(text: str) -> str:
    """Lower case, without punctuation: how readings and clauses are compared."""
    return re.sub(r"[^\w' ]", "", text).lower()


def without_repeats(text: str) -> str:
    """A decoder that loops ("turn on the LED, turn on the LED, turn on the") said it once."""
    clauses = [c.strip() for c in _CLAUSE.findall(text) if c.strip()]
    keys = [_plain(c) for c in clauses]
    for period in range(1, len(keys) // 2 + 1):
        whole = all(keys[i] == keys[i % period] for i in range(len(keys) - 1))
        last = keys[-1]
        if whole and keys[period] == keys[0] and keys[(len(keys) - 1) % period].startswith(last):
            return " ".join(clauses[:period]).rstrip(",;")
    return text


def transcript_of(decoded: Decoded) -> Transcript:
    """What the decoding process heard, as the bridge reads it: numbers as digits, a loop said
    once, a habitual invention on silence dropped, and readings that read the same merged
    (their beam shares added)."""
    text = without_repeats(decoded.text)
    if _plain(text).strip() in _HALLUCINATIONS and decoded.no_speech_prob > NO_SPEECH / 2:
        text = ""
    logprob = decoded.avg_logprob if decoded.avg_logprob is not None else -10.0
    sure = logprob >= UNSURE_LOGPROB and decoded.no_speech_prob < NO_SPEECH
    texts = [text, *(without_repeats(other) for other in decoded.alternatives)]
    shares = decoded.shares or (0.0,) * len(texts)
    heard = normalized(text)
    readings = {heard: 0.0}
    for reading, share in zip(map(normalized, texts), shares, strict=True):
        if reading or reading == heard:
            readings[reading] = readings.get(reading, 0.0) + share
    others = [reading for reading in readings if reading != heard]
    return Transcript(
        heard,
        ENGINE,
        "en",
        confidence=round(math.exp(logprob), 3),
        sure=sure,
        alternatives=tuple(others),
        shares=tuple(readings.values()) if decoded.shares else (),
    )


def looped(text: str) -> bool:
    """Whether a clause comes back three times or more ("light mode, light mode, light mode")."""
    keys = [key for key in (_plain(c).strip() for c in _CLAUSE.findall(text)) if key]
    return any(keys.count(key) >= LOOP_REPEATS for key in set(keys))


class WhisperRecognizer:
    """English speech, recognized by Whisper tiny.en in `DecodePool` processes."""

    name = ENGINE

    def __init__(self, *, workers: int = 1, threads: int = 2, queue_max: int = 8) -> None:
        spec = EngineSpec(
            "backend.voice.recognition.whisper:load", (str(model_dir()), threads), ENGINE
        )
        self.pool = DecodePool(spec, workers=workers, queue_max=queue_max)

    async def start(self) -> None:
        """Start the decoding processes (the model loads while the bridge goes on)."""
        self.pool.start()

    def backlog_s(self) -> float:
        """About how long a new utterance would wait for a decoding process."""
        return self.pool.backlog_s()

    async def recognize(self, pcm: bytes, hints: RecognitionHints) -> Transcript:
        """The text of one utterance; raises RecognizerBusy or RecognitionFailed."""
        return transcript_of(await self.pool.decode(pcm, hints.prompt))

    async def aclose(self) -> None:
        """Stop the decoding processes."""
        await self.pool.aclose()
