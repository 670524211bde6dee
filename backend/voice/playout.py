"""The playout clock: when each downlink frame may leave so the device never starves and
never overflows.

Frame n is due to start playing at `t0 + n × frame`; it is sent `lead` frames before that, so
the device holds at most `lead + 1` frames (the stock device keeps 40 and silently drops the
rest). The schedule is absolute, so sleep errors do not add up. When frame n leaves after it
was due (the device's buffer ran dry: synthesis fell behind, or the loop overslept), the clock
is re-based so n is due when it left, and `last_due` stays true.
"""

from dataclasses import dataclass


@dataclass(slots=True)
class PlayoutClock:
    """When each downlink frame may leave (see the module docstring); times in seconds."""

    frame_s: float
    lead: int
    _t0: float | None = None
    sent: int = 0

    def send_at(self, now: float) -> float:
        """When the next frame may be sent (at or before `now`: send it at once)."""
        self._rebase_if_late(now)
        assert self._t0 is not None
        return self._t0 + (self.sent - self.lead) * self.frame_s

    def mark_sent(self, now: float) -> None:
        """The next frame left at `now`."""
        self._rebase_if_late(now)
        self.sent += 1

    def _rebase_if_late(self, now: float) -> None:
        if self._t0 is None or now > self._t0 + self.sent * self.frame_s:
            self._t0 = now - self.sent * self.frame_s  # first frame, or the device ran dry

    @property
    def last_due(self) -> float | None:
        """When the device finishes playing the frames sent so far."""
        return None if self._t0 is None else self._t0 + self.sent * self.frame_s

    def in_flight(self, now: float) -> int:
        """Frames sent but not yet played, if the device started on time."""
        if self._t0 is None:
            return 0
        played = max(0.0, (now - self._t0) / self.frame_s)
        return max(0, self.sent - int(played))
