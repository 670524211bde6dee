"""Voice turns, stage by stage."""

from collections.abc import Mapping

from prometheus_client import Histogram

from backend.metrics.core import REGISTRY, STAGE_BUCKETS, SWITCH

# From the stamps of a spoken turn (backend/voice/timings.py, milliseconds from the end of
# speech): each stage's own share, and the whole wait the user hears.
VOICE_STAGES = {
    "vad": (None, "silence_wait_ms"),  # the detector's hangover before the turn ends
    "asr": ("end_of_speech_ms", "recognized_ms"),
    "llm": ("recognized_ms", "first_token_ms"),
    "tts": ("first_token_ms", "first_audio_ms"),
    "first_audio_out": ("end_of_speech_ms", "first_frame_sent_ms"),
}
_voice_stage_seconds = Histogram(
    "bridge_voice_stage_seconds",
    "Time each stage of a spoken turn took (first_audio_out: end of speech to the first frame).",
    ["stage"],
    buckets=STAGE_BUCKETS,
    registry=REGISTRY,
)
_voice_stage_children = {stage: _voice_stage_seconds.labels(stage) for stage in VOICE_STAGES}


def record_voice_turn(report: Mapping[str, float]) -> None:
    """A spoken turn ended; `report` is `TurnTimings.report()` (stages it never reached are
    absent and not observed)."""
    if not SWITCH.on:
        return
    for stage, (start, end) in VOICE_STAGES.items():
        end_ms = report.get(end)
        start_ms = 0.0 if start is None else report.get(start)
        if end_ms is not None and start_ms is not None and end_ms >= start_ms:
            _voice_stage_children[stage].observe((end_ms - start_ms) / 1000)
