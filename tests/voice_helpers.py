"""Speech for voice tests.

The embedded recognizer (pocketsphinx) misrecognizes raw eSpeak audio ("set the volume to
forty" → "suitable you are the") but gets the same speech right once it has passed through a
voice codec, as a stock device's Opus uplink does. A real microphone is not eSpeak; PCM16 tests
therefore send synthetic speech that went through one Opus round trip (16 kHz, VOIP,
complexity 0, like the stock device), so they test the PCM16 path, not eSpeak's spectrum.

Numbers the voice tests speak: ten, twenty, thirty, forty, seventy and ninety decoded right in
6 of 6 renderings each; "fifty" and "sixty" came back once in 6 as 58 and 68, and "fifteen" as
50 in 5 of 6, so the tests do not use them (the recognition set in test_voice_asr.py does).
"""

import opuslib_next

from backend.voice.audio import Clip, split_frames
from backend.voice.tts import render


def spoken(text: str, sample_rate: int = 16000) -> Clip:
    """`text` synthesized, passed through a voice codec, at `sample_rate`."""
    clip = render(text, "en", 16000)
    encoder = opuslib_next.Encoder(16000, 1, opuslib_next.APPLICATION_VOIP)
    encoder.complexity = 0
    decoder = opuslib_next.Decoder(sample_rate, 1)
    frame = sample_rate * 60 // 1000
    pcm = b"".join(
        decoder.decode(encoder.encode(chunk, 960), frame) for chunk in split_frames(clip.pcm, 16000)
    )
    return Clip(pcm, sample_rate)
