"""When each stage of a voice turn happened, reported relative to the end of speech."""

import time
from dataclasses import dataclass, field

STAGES = (
    "end_of_speech",  # the detector (or `listen stop`) ended the utterance
    "recognized",  # the recognizer's final text
    "first_token",  # the chat's first answer token
    "first_audio",  # the first synthesized PCM of the answer
    "first_frame_sent",  # the first downlink frame left the bridge
    "last_frame_due",  # when the device finishes playing the last frame
    "stopped",  # `tts stop` sent
)


@dataclass(slots=True)
class TurnTimings:
    """Monotonic stamps (`time.perf_counter`) of one turn; the first mark of a stage wins."""

    stamps: dict[str, float] = field(default_factory=dict)
    silence_wait_ms: float | None = None  # the detector's hangover, reported apart

    def mark(self, stage: str, at: float | None = None) -> None:
        """Stamp `stage` now (or `at`, perf_counter seconds); the first stamp of a stage wins."""
        self.stamps.setdefault(stage, time.perf_counter() if at is None else at)

    def report(self) -> dict[str, float]:
        """Milliseconds from the end of speech (or the turn's first stamp) to each stage."""
        if not self.stamps:
            return {}
        origin = self.stamps.get("end_of_speech", min(self.stamps.values()))
        report = {
            f"{stage}_ms": round((self.stamps[stage] - origin) * 1000, 3)
            for stage in STAGES
            if stage in self.stamps
        }
        if self.silence_wait_ms is not None:
            report["silence_wait_ms"] = round(self.silence_wait_ms, 1)
        return report
