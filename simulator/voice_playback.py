"""A model of the stock device's speaker (voice.md §4, protocol reference §3.3).

The firmware accepts downlink audio only while `speaking` (between `tts start` and `tts stop`),
pushes each packet into a decode queue of 40 packets without waiting (a packet that finds the
queue full is dropped) and plays one 60 ms packet after another. At `tts stop` it resets the
decoder, so whatever has not finished playing then is lost: the "last words cut off" bug.

The model is pure arithmetic on arrival times (no timers): a frame occupies the queue from its
arrival until the end of its 60 ms playback slot, which starts when it arrives or when the
previous frame ends, whichever is later (an empty queue restarts playback on arrival).
"""

from collections import deque
from dataclasses import dataclass

STOCK_QUEUE_FRAMES = 40
FRAME_MS = 60


@dataclass
class PlaybackCounters:
    accepted: int = 0
    dropped_outside_speaking: int = 0
    dropped_overflow: int = 0
    cut_at_stop: int = 0


class Playback:
    """Feed it `start(t)`, `offer(t)` for every frame, `stop(t)`; times in seconds."""

    def __init__(self, frame_ms: float = FRAME_MS, capacity: int = STOCK_QUEUE_FRAMES) -> None:
        self.frame_s = frame_ms / 1000
        self.capacity = capacity
        self.speaking = False
        self.counters = PlaybackCounters()
        self.max_in_flight = 0
        self.last_frame_end: float | None = None  # when the last accepted frame ends playing
        self.stopped_at: float | None = None
        self.played: list[int] = []  # indexes (in offer order) of frames played to their end
        self._offered = 0
        self._in_flight: deque[tuple[float, int]] = deque()  # (end of playback, index)

    def start(self, t: float) -> None:
        """`tts start`: the device enters speaking (a repeated start changes nothing)."""
        self.speaking = True

    def offer(self, t: float) -> bool:
        """A downlink frame arrives at `t`; True when the device queued it for playback."""
        index = self._offered
        self._offered += 1
        if not self.speaking:
            self.counters.dropped_outside_speaking += 1
            return False
        self._drain(t)
        if len(self._in_flight) >= self.capacity:
            self.counters.dropped_overflow += 1
            return False
        begins = max(t, self._in_flight[-1][0]) if self._in_flight else t
        self.last_frame_end = begins + self.frame_s
        self._in_flight.append((self.last_frame_end, index))
        self.counters.accepted += 1
        self.max_in_flight = max(self.max_in_flight, len(self._in_flight))
        return True

    def stop(self, t: float) -> None:
        """`tts stop`: the queue is reset; frames not yet finished are cut."""
        if not self.speaking:
            return
        self._drain(t)
        self.counters.cut_at_stop += len(self._in_flight)
        self._in_flight.clear()
        self.speaking = False
        self.stopped_at = t

    def in_flight(self, t: float) -> int:
        self._drain(t)
        return len(self._in_flight)

    def _drain(self, t: float) -> None:
        while self._in_flight and self._in_flight[0][0] <= t:
            self.played.append(self._in_flight.popleft()[1])
