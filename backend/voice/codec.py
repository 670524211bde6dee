"""Audio codecs at the edge of the voice loop: uplink packets to 16 kHz PCM16, downlink PCM16
to packets in the format and rate the server hello announced.

Opus comes from `opuslib-next-bundled` (it bundles libopus). PCM16 devices (MicroPython has no
Opus encoder) send and receive raw 16-bit little-endian mono frames.
"""

from typing import Any, Protocol

from backend.protocol import AudioParams
from backend.voice.audio import UPLINK_RATE, frame_samples
from backend.voice.errors import AudioDecodeError, VoiceUnavailable

OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
PCM_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
MAX_PACKET_MS = 120  # the longest Opus packet; PCM frames are held to the same bound
DOWNLINK_BITRATE = 24000
DOWNLINK_COMPLEXITY = 5  # voice.md §2: 0.12 ms per 24 kHz frame; complexity 10 costs 5× more


class UplinkDecoder(Protocol):
    """Turns the device's uplink packets into 16 kHz PCM16."""

    def decode(self, payload: bytes) -> bytes:
        """One uplink packet as 16 kHz PCM16; raises AudioDecodeError."""


class DownlinkEncoder(Protocol):
    """Turns frames of PCM16 into downlink packets in the format the hello announced."""

    sample_rate: int

    def encode(self, pcm: bytes) -> bytes:
        """One whole frame of PCM16 at `sample_rate` as one downlink packet."""


def _opus() -> Any:
    try:
        import opuslib_next
    except ImportError:
        raise VoiceUnavailable("Opus needs the opuslib-next-bundled package") from None
    return opuslib_next


class OpusUplink:
    """Opus at any rate decodes straight to 16 kHz (libopus resamples inside the decoder)."""

    def __init__(self) -> None:
        self._decoder = _opus().Decoder(UPLINK_RATE, 1)
        self._max_samples = frame_samples(UPLINK_RATE, MAX_PACKET_MS)

    def decode(self, payload: bytes) -> bytes:
        """One Opus packet as 16 kHz PCM16; raises AudioDecodeError on an empty or corrupt
        packet."""
        if not payload:
            raise AudioDecodeError("empty Opus packet")
        try:
            return bytes(self._decoder.decode(payload, self._max_samples))
        except Exception as exc:  # OpusError, or ctypes errors on absurd input
            raise AudioDecodeError(f"Opus packet does not decode: {exc}") from None


class PcmUplink:
    """Raw PCM16 at the rate the device's hello declared, resampled to 16 kHz when needed."""

    def __init__(self, sample_rate: int) -> None:
        if sample_rate not in PCM_RATES:
            raise AudioDecodeError(f"PCM16 at {sample_rate} Hz is not supported")
        self._max_bytes = frame_samples(sample_rate, MAX_PACKET_MS) * 2
        self._resampler = None
        if sample_rate != UPLINK_RATE:
            import soxr

            self._resampler = soxr.ResampleStream(sample_rate, UPLINK_RATE, 1, dtype="int16")

    def decode(self, payload: bytes) -> bytes:
        """One raw PCM16 frame (at most 120 ms), resampled to 16 kHz; raises AudioDecodeError."""
        if len(payload) % 2 or not payload:
            raise AudioDecodeError(f"PCM16 frame of {len(payload)} bytes (not whole samples)")
        if len(payload) > self._max_bytes:
            raise AudioDecodeError(f"PCM16 frame of {len(payload)} bytes is over 120 ms")
        if self._resampler is None:
            return bytes(payload)
        import numpy as np

        samples = np.frombuffer(payload, dtype=np.int16)
        return bytes(self._resampler.resample_chunk(samples).tobytes())


def uplink_decoder(params: AudioParams) -> UplinkDecoder:
    """The decoder for a device's hello `audio_params`; raises AudioDecodeError when unusable."""
    if params.format == "pcm16":
        return PcmUplink(params.sample_rate)
    if params.format == "opus":
        return OpusUplink()
    raise AudioDecodeError(f"uplink format {params.format!r} is not supported")


class OpusDownlink:
    """Encodes downlink frames as Opus at the announced rate."""

    def __init__(self, sample_rate: int) -> None:
        opus = _opus()
        self.sample_rate = sample_rate
        self._samples = frame_samples(sample_rate)
        self._encoder = opus.Encoder(sample_rate, 1, opus.APPLICATION_AUDIO)
        self._encoder.bitrate = DOWNLINK_BITRATE
        self._encoder.complexity = DOWNLINK_COMPLEXITY

    def encode(self, pcm: bytes) -> bytes:
        """One frame of PCM16 as one Opus packet."""
        return bytes(self._encoder.encode(pcm, self._samples))


class PcmDownlink:
    """Sends the PCM16 frames as they are (a hello that announced `pcm16`)."""

    def __init__(self, sample_rate: int) -> None:
        self.sample_rate = sample_rate

    def encode(self, pcm: bytes) -> bytes:
        """The frame unchanged."""
        return pcm


def downlink_encoder(params: AudioParams) -> DownlinkEncoder:
    """The encoder for what the server hello announced."""
    if params.format == "pcm16":
        return PcmDownlink(params.sample_rate)
    return OpusDownlink(params.sample_rate)
