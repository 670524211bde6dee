"""Per-device inbound limits: a device that floods the bridge is cut off, not served first."""

import time


class InboundLimit:
    """Two token buckets, messages per second and bytes per second, each holding `burst_s`
    seconds' worth. Generous by default (a device streams audio at ~17 frames/s); a flood at
    loopback speed empties them within a second.

    Answers are not unsolicited traffic: every request the bridge sends grants the device one
    more text message (of up to `reply_bytes`), so a burst of tool calls is never mistaken for a
    flood. Every frame is charged, whatever it holds: text (`allow`), and audio or a frame that
    could not even be decoded (`charge`, which no credit covers).
    """

    __slots__ = (
        "_byte_rate",
        "_bytes",
        "_bytes_cap",
        "_credit",
        "_last",
        "_message_rate",
        "_messages",
        "_messages_cap",
        "_reply_bytes",
    )

    def __init__(
        self,
        messages_per_s: float,
        bytes_per_s: float,
        *,
        burst_s: float = 2.0,
        reply_bytes: int = 65536,
    ) -> None:
        self._message_rate = messages_per_s
        self._byte_rate = bytes_per_s
        self._messages_cap = messages_per_s * burst_s
        self._bytes_cap = bytes_per_s * burst_s
        self._messages = self._messages_cap
        self._bytes = self._bytes_cap
        self._last = time.monotonic()
        self._credit = 0
        self._reply_bytes = reply_bytes

    def expect_reply(self) -> None:
        """The bridge sent a request: its answer does not count against the device."""
        self._credit += 1

    def allow(self, size: int) -> bool:
        """Take one text message of `size` bytes, which may be an answer to one of the bridge's
        requests (then it is free); False once either bucket is empty."""
        if self._credit and size <= self._reply_bytes:
            self._credit -= 1
            return True
        return self.charge(size)

    def charge(self, size: int) -> bool:
        """Take one frame of `size` bytes that cannot be an answer (audio, or a frame the
        transport could not decode or deliver); False once either bucket is empty."""
        now = time.monotonic()
        elapsed = now - self._last
        self._last = now
        self._messages = min(self._messages_cap, self._messages + elapsed * self._message_rate) - 1
        self._bytes = min(self._bytes_cap, self._bytes + elapsed * self._byte_rate) - size
        return self._messages >= 0 and self._bytes >= 0
