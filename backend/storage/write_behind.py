"""Write-behind: state changes in memory on the hot path; a task writes them in batches.

The owner marks what changed and calls `wake()`; the task waits `interval_s` so a burst of
changes becomes one transaction, then calls the owner's `flush`. A flush that fails keeps its
rows for the next one (the owner's job) and raises `DatabaseError`; the task carries on. Each
flush is timed (`bridge_db_flush_seconds`), and an owner that says how many changes it holds
(`depth`) is read at scrape (`bridge_db_write_queue_depth`).
"""

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from backend.metrics import record_flush, unwatch_write_queue, watch_write_queue
from backend.storage.database import DatabaseError


class WriteBehind:
    """Runs `flush` after each burst of `wake()` calls, and, with `heartbeat_s`, calls
    `on_heartbeat` (then flushes) at least that often even when nothing wakes it."""

    __slots__ = (
        "__weakref__",  # the metrics' gauge holds writers weakly
        "_depth",
        "_flush",
        "_heartbeat_s",
        "_interval_s",
        "_lock",
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
        depth: Callable[[], int] | None = None,
    ) -> None:
        """`depth`: how many changes the owner holds for the next flush (for the metrics)."""
        self._flush = flush
        self._depth = depth
        self._name = name
        self._interval_s = interval_s
        self._heartbeat_s = heartbeat_s
        self._on_heartbeat = on_heartbeat
        self._wake = asyncio.Event()
        # One flush at a time: a caller's flush() that ran while the task's was still writing
        # found nothing pending and returned before those rows were stored.
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        """The writer's name (its task's name and metric label)."""
        return self._name

    def depth(self) -> int:
        """How many changes the owner holds unwritten (0 if it does not say)."""
        return self._depth() if self._depth is not None else 0

    def start(self) -> None:
        """Start the writer task and report its queue depth to metrics."""
        self._task = asyncio.create_task(self._run(), name=self._name)
        if self._depth is not None:
            watch_write_queue(self)

    def wake(self) -> None:
        """Say something changed: a flush follows after `interval_s`."""
        self._wake.set()

    async def stop(self) -> None:
        """Stop the task; the owner writes what is still pending itself."""
        unwatch_write_queue(self)
        if self._task is not None:
            async with self._lock:  # never cancel a flush halfway: its rows would be lost
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
                await self.flush()

    async def flush(self) -> None:
        """Run the owner's flush once any flush in progress has finished, so that on return
        everything changed before the call is written (or `DatabaseError` was raised)."""
        async with self._lock:
            began = time.perf_counter()
            try:
                await self._flush()
            finally:
                record_flush(self._name, time.perf_counter() - began)

    def _next_heartbeat(self, loop: asyncio.AbstractEventLoop) -> float | None:
        return None if self._heartbeat_s is None else loop.time() + self._heartbeat_s
