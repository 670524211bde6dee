"""How the admin and metrics listeners serve HTTP: uvicorn, with the bounds it lacks.

uvicorn times a connection out only between requests (`timeout_keep_alive`, armed after a
response), caps nothing per address, and leaves accepting to asyncio, whose accept loop on
Python 3.11 keeps calling `accept()` after EMFILE for the rest of its batch (uvicorn's batch is
its backlog, 2,048) and schedules a retry for each failure: a listener out of descriptors spins
the event loop (issue #32: 6,000 idle sockets held the admin port, descriptors 19 → 6,019,
1.6 million failed accepts). Here:

- `HttpListener` runs uvicorn on a listening socket but accepts connections itself
  (`Acceptor`): at most `ACCEPT_BATCH` per wakeup, and on EMFILE/ENFILE/ENOBUFS/ENOMEM it stops
  accepting for `ACCEPT_PAUSE_S` (one warning when a burst starts, one line once none failed
  for `BURST_GAP_S`).
- Each connection passes the device listeners' `ConnectionGuard` at `connection_made`, before a
  byte is parsed: at most `http_max_connections` open at once (never more than a quarter of the
  open-file limit), `http_max_connections_per_address` per address and `rate_limits.connection_ip`
  new ones per address (`rate_limit_exempt`, loopback by default, is not limited per address).
  A connection upgraded to a WebSocket (the MCP endpoint, the talk page) counts until it closes.
- A connection that has not sent a whole request head within `http_head_timeout_s` of opening
  (or of its last response), or whose head grows past `MAX_HEAD_BYTES`, is closed; an idle
  kept-alive one after `http_keep_alive_s` (uvicorn's own timer).
"""

import asyncio
import contextlib
import errno
import functools
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import structlog
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol

from backend.transports.throttle import ConnectionGuard, ExemptNetworks, KeyedLimiter

if TYPE_CHECKING:
    from backend.api.gate import AsgiApp
    from backend.config import Settings

log = structlog.get_logger("http.listener")

ACCEPT_BATCH = 64  # accepts per loop wakeup; the rest wait in the kernel's queue
ACCEPT_PAUSE_S = 0.5  # no accept() for this long after the process ran out of descriptors
BURST_GAP_S = 5.0  # pauses closer together than this are one burst: one warning, one summary
MAX_HEAD_BYTES = 65536  # a request line and headers larger than this: the connection is closed
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True, slots=True)
class ListenerLimits:
    """The bounds of one HTTP listener (from `Settings.http_*`)."""

    head_timeout_s: float
    keep_alive_s: float
    max_connections: int
    max_per_address: int
    rate_per_s: float
    rate_burst: int
    exempt: tuple[str, ...]

    @classmethod
    def of(cls, settings: "Settings") -> Self:
        """The admin and metrics listeners' bounds from the settings."""
        rate = settings.rate_limits["connection_ip"]
        return cls(
            head_timeout_s=settings.http_head_timeout_s,
            keep_alive_s=settings.http_keep_alive_s,
            max_connections=settings.http_max_connections,
            max_per_address=settings.http_max_connections_per_address,
            rate_per_s=rate.per_s,
            rate_burst=rate.burst,
            exempt=tuple(settings.rate_limit_exempt),
        )

    def guard(self, name: str) -> ConnectionGuard:
        """A fresh `ConnectionGuard` for one listener (counts are per listener)."""
        return ConnectionGuard(
            connection_cap(self.max_connections),
            KeyedLimiter(self.rate_per_s, self.rate_burst),
            exempt=ExemptNetworks(self.exempt),
            logger=log.bind(listener=name),
            max_pending_per_address=self.max_per_address,
            transport=name,
        )


def connection_cap(configured: int) -> int:
    """At most a quarter of the open-file limit may be held by one HTTP listener, whatever the
    setting (the device handshakes may take half: `throttle.handshake_cap`)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return configured if soft == resource.RLIM_INFINITY else max(1, min(configured, soft // 4))


def _address(peer: object) -> str | None:
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


def _guarded_http(guard: ConnectionGuard, head_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP protocol behind `guard`, with a deadline and a size cap for each head."""

    class GuardedHttp(HttpToolsProtocol):
        _refused = False
        _deadline: asyncio.TimerHandle | None = None
        _waiting_after: object = None  # the request answered last (None: none yet)
        _head_bytes = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if not guard.admit(transport, _address(transport.get_extra_info("peername"))):
                self._refused = True
                if isinstance(transport, asyncio.Transport):
                    transport.abort()
                return
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm_deadline()

        def data_received(self, data: bytes) -> None:
            reading_head = self.cycle is self._waiting_after
            super().data_received(data)
            if not reading_head or self.cycle is not self._waiting_after or self.upgraded():
                return  # the head was whole before, or is now (the rest is the body's)
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self.transport.abort()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            if self._deadline is not None:
                self._deadline.cancel()
            guard.done(self.transport)
            super().connection_lost(exc)

        def upgraded(self) -> bool:
            """Whether the connection became a WebSocket (served by another protocol now)."""
            return self.transport.get_protocol() is not self

        def _arm_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._waiting_after = self.cycle
            self._head_bytes = 0
            self._deadline = self.loop.call_later(head_timeout_s, self._expire, self.cycle)

        def _expire(self, waiting_after: object) -> None:
            transport = self.transport
            if self.cycle is not waiting_after or transport.is_closing():
                return  # a request came in: its response re-arms the deadline
            if self.upgraded():
                return  # upgraded to a WebSocket, which has timeouts of its own
            if transport.get_write_buffer_size():
                transport.abort()  # a peer that reads nothing would keep a close() waiting
            else:
                transport.close()

    return GuardedHttp


def _guarded_ws(guard: ConnectionGuard) -> Any:
    """uvicorn's WebSocket protocol, releasing the connection's place in `guard` when it ends
    (after an upgrade the HTTP protocol no longer hears of the connection)."""
    base: Any = AutoWebSocketsProtocol
    if base is None:
        return "none"

    class GuardedWebSocket(base):  # type: ignore[misc]
        def connection_lost(self, exc: Exception | None) -> None:
            guard.done(self.transport)
            super().connection_lost(exc)

    return GuardedWebSocket


class Acceptor:
    """Accepts connections on a listening socket for a protocol factory, in batches, and backs
    off when the process is out of descriptors instead of retrying at once. Quacks like the
    `asyncio.Server` uvicorn keeps in `servers` (`close`, `wait_closed`)."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Any,
        name: str,
        *,
        batch: int = ACCEPT_BATCH,
        pause_s: float = ACCEPT_PAUSE_S,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._fd = sock.fileno()
        self._factory = factory
        self._name = name
        self._batch = batch
        self._pause_s = pause_s
        self._connecting: set[asyncio.Task[None]] = set()
        self._resume: asyncio.TimerHandle | None = None
        self._closed = False
        self._warned: set[int | None] = set()  # other accept errors: one line per errno
        self.failed_accepts = 0  # for lack of descriptors or memory, since start
        self._burst_began: float | None = None
        self._burst_failures = 0
        self._burst_end: asyncio.TimerHandle | None = None
        self._loop.add_reader(self._fd, self._accept)

    def _accept(self) -> None:
        for _ in range(self._batch):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    self._pause(exc)
                elif exc.errno not in self._warned:
                    self._warned.add(exc.errno)
                    log.warning("accept failed", listener=self._name, error=str(exc))
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except (OSError, RuntimeError):
            conn.close()

    def _pause(self, exc: OSError) -> None:
        """Out of descriptors: stop accepting for a while (the kernel keeps the queue)."""
        self.failed_accepts += 1
        self._burst_failures += 1
        if self._burst_began is None:
            self._burst_began = time.monotonic()
            log.warning(
                "accepting paused: out of file descriptors",
                listener=self._name,
                error=errno.errorcode.get(exc.errno or 0, str(exc)),
                pause_s=self._pause_s,
            )
        self._loop.remove_reader(self._fd)
        self._resume = self._loop.call_later(self._pause_s, self._resume_accepting)
        if self._burst_end is not None:
            self._burst_end.cancel()
        self._burst_end = self._loop.call_later(BURST_GAP_S, self._burst_ended)

    def _resume_accepting(self) -> None:
        self._resume = None
        if not self._closed:
            self._loop.add_reader(self._fd, self._accept)

    def _burst_ended(self) -> None:
        """No accept has failed for `BURST_GAP_S`: one line for the whole burst."""
        self._burst_end = None
        if self._burst_began is None:
            return
        log.info(
            "accepting again",
            listener=self._name,
            burst_s=round(time.monotonic() - self._burst_began - BURST_GAP_S, 1),
            failed_accepts=self._burst_failures,
        )
        self._burst_began = None
        self._burst_failures = 0

    def close(self) -> None:
        """Stop accepting (the socket itself is closed by its owner)."""
        if self._closed:
            return
        self._closed = True
        for timer in (self._resume, self._burst_end):
            if timer is not None:
                timer.cancel()
        self._resume = self._burst_end = None
        self._loop.remove_reader(self._fd)

    async def wait_closed(self) -> None:
        """Wait for the connections accepted but not yet handed to their protocol."""
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (the bridge owns SIGINT/SIGTERM) and with our
    `Acceptor` in place of asyncio's accept loop."""

    def __init__(self, config: uvicorn.Config, name: str) -> None:
        super().__init__(config)
        self._name = name
        self.acceptors: list[Acceptor] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # lifespan and state; no asyncio server
        protocol: Any = self.config.http_protocol_class
        factory = functools.partial(
            protocol,
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )
        self.acceptors = [Acceptor(sock, factory, self._name) for sock in sockets or []]
        self.servers = self.acceptors  # type: ignore[assignment]  # shutdown closes them


class HttpListener:
    """`app` served on `sock` by uvicorn with the bounds above; `start()` returns once serving."""

    def __init__(
        self,
        app: "AsgiApp",
        sock: socket.socket,
        limits: ListenerLimits,
        name: str,
        **options: Any,
    ) -> None:
        self.guard = limits.guard(name)
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=max(1, round(limits.keep_alive_s)),
            http=_guarded_http(self.guard, limits.head_timeout_s),
            ws=_guarded_ws(self.guard),
            **options,
        )
        # uvicorn takes whole seconds for keep-alive only in its type hints; it uses call_later.
        config.timeout_keep_alive = limits.keep_alive_s  # type: ignore[assignment]
        self.socket = sock
        self.name = name
        self.server = _Server(config, name)
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The bound port."""
        port: int = self.socket.getsockname()[1]
        return port

    @property
    def failed_accepts(self) -> int:
        """accept() calls that failed for lack of descriptors or memory."""
        return sum(acceptor.failed_accepts for acceptor in self.server.acceptors)

    async def start(self, what: str) -> None:
        """Serve until `stop()`; raises when uvicorn stops during its startup."""
        self._task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self._task.done():
                try:
                    await self._task  # surfaces the startup error
                except SystemExit as exc:  # uvicorn's way of failing a startup
                    raise RuntimeError(f"{what} stopped during startup") from exc
                raise RuntimeError(f"{what} stopped during startup")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop accepting, let open responses finish, close the socket."""
        if self._task is not None:
            self.server.should_exit = True
            await self._task
            self._task = None
        self.socket.close()
