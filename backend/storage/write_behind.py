"""Write-behind: state changes in memory on the hot path; a task writes them in batches.

The owner marks what changed and calls `wake()`; the task waits `interval_s` so a burst of
changes becomes one transaction, then calls the owner's `flush`. A flush that fails keeps its
rows for the next one (the owner's job) and raises `DatabaseError`; the task carries on.
"""

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from backend.storage.database import DatabaseError


class WriteBehind:
    """Runs `flush` after each burst of `wake()` calls, and, with `heartbeat_s`, calls
    `on_heartbeat` (then flushes) at least that often even when nothing wakes it."""

    __slots__ = (
        "_flush",
        "_heartbeat_s",
        "_interval_s",
        "_name",
        "_on_heartbeat",
        "_task",
        "_wake",
    )

    def __init__(
        self,
        flush: Callable[[], Awaitable[None]],
        *,
        name: str,
        interval_s: float,
        heartbeat_s: float | None = None,
        on_heartbeat: Callable[[], None] = lambda: None,
    ) -> None:
        self._flush = flush
        self._name = name
        self._interval_s = interval_s
        self._heartbeat_s = heartbeat_s
        self._on_heartbeat = on_heartbeat
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self._name)

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        """Stop the task; the owner writes what is still pending itself."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        heartbeat = self._next_heartbeat(loop)
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(heartbeat):  # None: no heartbeat, wait for a wake
                    await self._wake.wait()
            if heartbeat is not None and loop.time() >= heartbeat:
                self._on_heartbeat()
                heartbeat = self._next_heartbeat(loop)
            await asyncio.sleep(self._interval_s)  # a burst becomes one transaction
            self._wake.clear()
            with contextlib.suppress(DatabaseError):
                await self._flush()

    def _next_heartbeat(self, loop: asyncio.AbstractEventLoop) -> float | None:
        return None if self._heartbeat_s is None else loop.time() + self._heartbeat_s
