"""Configured servers: connect once with the official SDK, keep connected, back off on failure.

A `ConfiguredServer` runs one supervisor task: open the transport (`stdio_client` spawns the
command; `streamable_http_client` talks to the url), `initialize`, list the tools, then watch
the connection. The connection counts as lost when a request answers "connection closed" (a
crashed child, a closed HTTP session) or a health ping gets no answer in `timeout_s`; then the
session is torn down and the supervisor waits (exponential backoff with jitter, reset after a
connection that worked) before it connects again. While it waits the server is `backing-off`
and its tools are not offered; calls in flight fail with a clear error, and no other
conversation is touched.
"""

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import structlog
from mcp import ClientSession
from mcp import types as mcp_types
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CONNECTION_CLOSED

from backend.common import Backoff
from backend.logs import redact_library_urls, redact_url
from backend.mcp_servers.errors import CallTimedOut, McpServerError
from backend.mcp_servers.servers import RiskyRule, ServerState, SessionServer, describe_error
from backend.mcp_servers.settings import McpServerSettings
from backend.mcp_session import CallResult

log = structlog.get_logger("mcp_servers")

# How long stop() lets a connection in progress end by itself: the SDK's 2 s for the server to
# exit on stdin's close, then its terminate and kill, with room to spare.
STOP_GRACE_S = 10.0
CLIENT_INFO = mcp_types.Implementation(name="esp32-mcp-bridge", version="0.1.0")


class ConfiguredServer(SessionServer):
    """A `[[mcp_servers]]` entry, connected and reconnected by the hub."""

    def __init__(
        self,
        settings: McpServerSettings,
        *,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 60.0,
        health_interval_s: float = 15.0,
    ) -> None:
        super().__init__(
            settings.name,
            kind=settings.kind,
            bound_device_ids=(
                frozenset(settings.device_ids) if settings.device_ids is not None else None
            ),
            risky=RiskyRule.from_setting(settings.risky),
            timeout_s=settings.timeout_s,
            max_result_bytes=settings.max_result_bytes,
            max_pending_calls=settings.max_pending_calls,
            tool_bounds=settings.tool_bounds(),
        )
        self.settings = settings
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.health_interval_s = health_interval_s
        self.connects = 0
        self.next_attempt_in_s: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._lost = asyncio.Event()
        self._stopping = False
        self._in_session = False  # inside the SDK's transport context: stop it from within
        self._handshake: asyncio.Timeout | None = None
        self._sleep = asyncio.sleep  # the wait between attempts (a test records it)

    async def start(self) -> None:
        """Start the supervisor task that connects and reconnects (idempotent)."""
        if self._task is None or self._task.done():
            redact_library_urls()  # the SDK and httpx log the url, with its secrets, at INFO
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(
                self._supervise(), name=f"mcp-server-{self.name}"
            )

    async def stop(self) -> None:
        """Stop the supervisor and close the connection; errors on the way out are swallowed.

        A connection in progress is ended from within (the handshake's deadline expires now, the
        watch wakes), not by cancelling the task: cancelled inside its stdio transport, the SDK
        drains the server's stdout until EOF before it kills the server, and a server that
        keeps stdout open and never answers held the bridge's shutdown for as long as it lived.
        """
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            if self._in_session:
                self._lost.set()
                if self._handshake is not None:
                    self._handshake.reschedule(asyncio.get_running_loop().time())
                await asyncio.wait([task], timeout=STOP_GRACE_S)
            task.cancel()  # between attempts (or past the grace): nothing of the SDK's is open
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.detach("stopped", state=ServerState.STOPPED)

    def summary(self) -> dict[str, Any]:
        """The listing plus connects, relists, the next attempt and the target (never args, env,
        headers)."""
        data = super().summary()
        data["connects"] = self.connects
        data["relists"] = self.relists
        data["next_attempt_in_s"] = self.next_attempt_in_s
        url = self.settings.url  # never args, env, headers; a url without its secrets
        data["target"] = self.settings.command or (redact_url(url) if url is not None else None)
        return data

    async def call(
        self, tool: str, arguments: dict[str, Any], *, timeout_s: float | None = None
    ) -> CallResult:
        """Call a tool; an error from a closed connection also wakes the supervisor to reconnect."""
        try:
            return await super().call(tool, arguments, timeout_s=timeout_s)
        except CallTimedOut:
            raise  # a slow tool, not a dead server: the health ping decides that
        except McpServerError as exc:
            if _closed(exc.__cause__):
                self._lost.set()
            raise

    # ---- the supervisor -----------------------------------------------------------------------

    async def _supervise(self) -> None:
        backoff = Backoff(self.backoff_initial_s, self.backoff_max_s, jitter=(0.8, 1.2))
        while True:
            self._set_state(ServerState.CONNECTING)
            self.next_attempt_in_s = None
            worked = False
            try:
                worked = await self._connect_and_watch()
                error = "connection lost"
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = describe_error(_unwrapped(exc))
            if self._stopping:
                return
            if worked:
                backoff.reset()
            wait = backoff.next_wait()
            self.detach(error, state=ServerState.BACKING_OFF)
            self.next_attempt_in_s = round(wait, 3)
            log.warning("mcp server down", server=self.name, error=error, retry_in_s=wait)
            await self._sleep(wait)

    async def _connect_and_watch(self) -> bool:
        """Connect, serve until the connection is lost; True if it got to READY."""
        self._lost = asyncio.Event()
        self._in_session = True
        try:
            return await self._session_until_lost()
        finally:
            self._in_session = False
            self._handshake = None

    async def _session_until_lost(self) -> bool:
        async with contextlib.AsyncExitStack() as stack:
            read, write = await stack.enter_async_context(self._transport())
            session = await stack.enter_async_context(
                ClientSession(
                    read, write, message_handler=self.message_handler, client_info=CLIENT_INFO
                )
            )
            if self._stopping:  # stop() came while the server was starting
                return False
            try:
                async with asyncio.timeout(self.settings.connect_timeout_s) as self._handshake:
                    await session.initialize()
                    await self.attach(session)
            finally:
                self._handshake = None
            self.connects += 1
            try:
                await self._watch(session)
            finally:
                if not self._stopping:
                    self.detach("connection lost", state=ServerState.BACKING_OFF)
        return True

    async def _watch(self, session: ClientSession) -> None:
        while not self._lost.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.health_interval_s):
                    await self._lost.wait()
            if self._lost.is_set():
                return
            try:
                async with asyncio.timeout(self.timeout_s):
                    await session.send_ping()
            except (TimeoutError, MCPError, Exception) as exc:
                log.warning(
                    "mcp server health ping failed", server=self.name, error=describe_error(exc)
                )
                return

    def _transport(self) -> contextlib.AbstractAsyncContextManager[Any]:
        settings = self.settings
        if settings.command is not None:
            parameters = StdioServerParameters(
                command=settings.command,
                args=list(settings.args),
                env={key: value.get_secret_value() for key, value in settings.env.items()},
                cwd=settings.cwd,
                encoding_error_handler="replace",
            )
            return stdio_client(parameters, errlog=sys.stderr)
        assert settings.url is not None
        return _http_transport(
            settings.url,
            settings.http_headers(),
            settings.connect_timeout_s,
            settings.max_message_bytes,
        )

    async def message_handler(self, message: Any) -> None:
        """Note a closed connection (to reconnect), then handle the message as usual."""
        if isinstance(message, Exception) and _closed(message):
            self._lost.set()
        await super().message_handler(message)


@contextlib.asynccontextmanager
async def _http_transport(
    url: str, headers: dict[str, str], connect_timeout_s: float, max_message_bytes: int
) -> AsyncIterator[Any]:
    """The SDK's Streamable HTTP transport; an SSE event over `max_message_bytes` is refused
    while it is read (a plain JSON response body is read whole by the SDK: no bound but time)."""
    timeout = httpx2.Timeout(connect_timeout_s, read=300.0)
    async with (
        create_mcp_http_client(headers=headers, timeout=timeout) as client,
        streamable_http_client(
            url, http_client=client, max_sse_event_size=max_message_bytes
        ) as streams,
    ):
        yield streams


def _closed(exc: BaseException | None) -> bool:
    return isinstance(exc, MCPError) and getattr(exc, "code", None) == CONNECTION_CLOSED


def _unwrapped(exc: BaseException) -> BaseException:
    """The first real error inside anyio's exception groups (the SDK's task groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc
