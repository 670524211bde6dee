"""The device HTTP listener's connection protocol: uvicorn's h11 protocol, bounded.

- **At accept**, before a byte is parsed, the connection is put to the listener's
  `ConnectionGuard` (the WebSocket and MQTT listeners' class and settings: a per-address rate
  `rate_limits.connection_ip`, a per-address share `max_pending_handshakes_per_address` of open
  connections, a penalty box for addresses whose requests keep being refused, a global cap).
  A refused connection is aborted at once: no parser, no task, no log line (counted in
  `bridge_connections_refused_total` and in one budgeted line).
- **A request head** must start within `head_s` of opening the connection (or of its last
  response): uvicorn times a connection out only between requests, so a socket that never sends
  a byte would hold a slot for good.
- **Closing with an unread body** (a refusal answered before the body was read: 413, 401, 429,
  408) half-closes instead of closing: the response is flushed and followed by a FIN, and the rest
  of the body is read and dropped (at most `LINGER_MAX_BYTES`, for at most `LINGER_S`) before the
  socket is closed. Closing a socket with unread data makes the kernel send a reset, and a client
  still sending its body would often see the reset instead of the answer (nginx and Apache do the
  same "lingering close").
"""

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from backend.transports.throttle import ConnectionGuard

LINGER_S = 5.0  # a refused body still arriving is read and dropped for at most this long
LINGER_MAX_BYTES = 8 << 20  # and at most this much of it


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: `close()` lingers while the request's
    body is still arriving (see the module docstring); everything else is the real one."""

    def __init__(self, raw: asyncio.Transport, protocol: "DeviceHttpProtocol") -> None:
        self._raw = raw
        self._protocol = protocol

    def close(self) -> None:
        self._protocol.close_connection()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._raw.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class DeviceHttpProtocol(H11Protocol):
    """uvicorn's h11 protocol behind the listener's guard, with a head deadline and a lingering
    close (module docstring). `bound` makes the class of one listener."""

    guard: ConnectionGuard
    head_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # uvicorn's own set-up (an h11 parser, its state) waits until the guard admits the
        # connection: a refused one costs a stored tuple, so a storm of them stays cheap.
        self._init_args = (args, kwargs)

    @classmethod
    def bound(cls, guard: ConnectionGuard, head_s: float) -> type["DeviceHttpProtocol"]:
        """A subclass for one listener: its guard and its head deadline."""
        return type("BoundDeviceHttpProtocol", (cls,), {"guard": guard, "head_s": head_s})

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Admit the connection through the guard (or abort it) and arm the head deadline."""
        self._refused = False
        self.lingering = False
        self._linger_left = 0
        self._linger_timer: asyncio.TimerHandle | None = None
        self._deadline: asyncio.TimerHandle | None = None
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else None
        if not self.guard.admit(self, address):
            self._refused = True
            if isinstance(transport, asyncio.Transport):
                transport.abort()
            return
        assert isinstance(transport, asyncio.Transport)
        args, kwargs = self._init_args
        super().__init__(*args, **kwargs)
        self._raw = transport
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._arm_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        """Give the connection's share back to the guard."""
        if self._refused:
            return
        self.guard.done(self)
        for timer in (self._deadline, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def peer_address(self) -> str | None:
        """The client's IP (None for an unknown peer)."""
        return self.client[0] if self.client else None

    # ---- the request head's deadline ------------------------------------------------------------

    def on_response_complete(self) -> None:
        """The next request's head is due within `head_s`."""
        super().on_response_complete()
        self._arm_deadline()

    def _arm_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        waiting_after = self.cycle  # the request answered last (None: none yet)
        self._deadline = self.loop.call_later(self.head_s, self._expire, waiting_after)

    def _expire(self, waiting_after: object) -> None:
        if self.cycle is waiting_after and not self.transport.is_closing():
            self.transport.close()

    # ---- lingering close ------------------------------------------------------------------------

    def close_connection(self) -> None:
        """Close, or half-close and drop the rest of a request body that is still arriving."""
        raw = self._raw
        if raw.is_closing():
            return
        if self.lingering:  # asked again (the listener shutting down): now
            raw.close()
            return
        cycle = self.cycle
        body_arriving = cycle is not None and cycle.more_body and not cycle.disconnected
        if not body_arriving or not raw.can_write_eof():
            raw.close()
            return
        self.lingering = True
        self._linger_left = LINGER_MAX_BYTES
        try:
            raw.write_eof()  # a FIN after the buffered answer: the client reads it, then EOF
        except OSError:
            raw.close()
            return
        raw.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, raw.close)

    def data_received(self, data: bytes) -> None:
        """Parse, or while lingering drop (within `LINGER_MAX_BYTES`)."""
        if not self.lingering:
            super().data_received(data)
            return
        self._linger_left -= len(data)
        if self._linger_left <= 0:
            self._raw.close()

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client is done sending: a lingering connection closes."""
        if self.lingering:
            self._raw.close()  # the client sent all it had and read the answer
        return None
