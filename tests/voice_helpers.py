"""Speech for voice tests.

A real microphone is not eSpeak, and a stock device sends Opus: PCM16 tests therefore send
synthetic speech that went through one Opus round trip (16 kHz, VOIP, complexity 0, like the
stock device), so they test the PCM16 path with the speech the recognizer hears from devices,
not eSpeak's raw spectrum. (The recognizer before Whisper, pocketsphinx, misrecognized raw
eSpeak audio outright; Whisper tiny.en hears both, but the tests keep the device's path.)

Numbers the voice tests speak: ten, twenty, thirty, forty, seventy and ninety. The spoken
recognition set (testkit/recognition_set.py, used by tests/test_voice_recognition.py and
bench/voice_recognition.py) has the rest.
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
