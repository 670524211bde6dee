"""PCM helpers of the voice loop: frame sizes, WAV files, levels.

All audio inside the bridge is PCM16: signed 16-bit little-endian mono, as bytes. The uplink is
16 kHz (the stock device's microphone); the downlink is whatever the server hello announced.
"""

import io
import wave
from dataclasses import dataclass
from pathlib import Path

UPLINK_RATE = 16000
FRAME_MS = 60
SAMPLE_BYTES = 2


def frame_samples(sample_rate: int, frame_ms: int = FRAME_MS) -> int:
    """Samples in one frame of `frame_ms` at this rate."""
    return sample_rate * frame_ms // 1000


def frame_bytes(sample_rate: int, frame_ms: int = FRAME_MS) -> int:
    """Bytes of PCM16 mono in one frame of `frame_ms` at this rate."""
    return frame_samples(sample_rate, frame_ms) * SAMPLE_BYTES


def duration_ms(pcm: bytes, sample_rate: int) -> float:
    """How long PCM16 mono audio at this rate plays, in ms."""
    return len(pcm) / SAMPLE_BYTES / sample_rate * 1000


@dataclass(frozen=True, slots=True)
class Clip:
    """A piece of mono PCM16 audio and its rate."""

    pcm: bytes
    sample_rate: int

    @property
    def duration_ms(self) -> float:
        """How long the clip plays, in ms."""
        return duration_ms(self.pcm, self.sample_rate)


def wav_bytes(clip: Clip) -> bytes:
    """A RIFF/WAV file of the clip (what /v1/audio/transcriptions takes)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(SAMPLE_BYTES)
        out.setframerate(clip.sample_rate)
        out.writeframes(clip.pcm)
    return buffer.getvalue()


def write_wav(path: Path, clip: Clip) -> None:
    """Write the clip as a WAV file."""
    path.write_bytes(wav_bytes(clip))


def read_wav(source: Path | bytes) -> Clip:
    """A mono 16-bit WAV file; raises ValueError for anything else."""
    data = source.read_bytes() if isinstance(source, Path) else source
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            if wav.getnchannels() != 1 or wav.getsampwidth() != SAMPLE_BYTES:
                raise ValueError(
                    f"need mono 16-bit PCM, got {wav.getnchannels()} channel(s) of "
                    f"{wav.getsampwidth() * 8} bits"
                )
            return Clip(wav.readframes(wav.getnframes()), wav.getframerate())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"not a WAV file: {exc}") from None


def split_frames(pcm: bytes, sample_rate: int, frame_ms: int = FRAME_MS) -> list[bytes]:
    """Consecutive frames; the last one padded with silence to a whole frame."""
    size = frame_bytes(sample_rate, frame_ms)
    frames = [pcm[start : start + size] for start in range(0, len(pcm), size)]
    if frames and len(frames[-1]) < size:
        frames[-1] = frames[-1] + bytes(size - len(frames[-1]))
    return frames
