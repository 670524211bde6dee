"""The write-behind task the catalogue, the audit log and the provisioning store share: a burst
of wakes is one flush, a failed flush does not stop it, a heartbeat flushes without a wake."""

import asyncio

from backend.storage import DatabaseError, WriteBehind
from tests.helpers import eventually


class Flushes:
    def __init__(self, failures: int = 0) -> None:
        self.calls = 0
        self.failures = failures

    async def __call__(self) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise DatabaseError("disk full")


async def test_a_burst_of_wakes_is_one_flush() -> None:
    flushes = Flushes()
    writer = WriteBehind(flushes, name="test-writer", interval_s=0.2)
    writer.start()
    try:
        for _ in range(100):
            writer.wake()
        await eventually(lambda: flushes.calls == 1)
        writer.wake()
        await eventually(lambda: flushes.calls == 2)
        assert flushes.calls == 2
    finally:
        await writer.stop()


async def test_a_failed_flush_leaves_the_task_running() -> None:
    flushes = Flushes(failures=1)
    writer = WriteBehind(flushes, name="test-writer", interval_s=0.01)
    writer.start()
    try:
        writer.wake()
        await eventually(lambda: flushes.calls == 1)
        writer.wake()
        await eventually(lambda: flushes.calls == 2)
    finally:
        await writer.stop()


async def test_the_heartbeat_flushes_without_a_wake_and_stop_ends_the_task() -> None:
    flushes = Flushes()
    beats: list[int] = []
    writer = WriteBehind(
        flushes,
        name="test-writer",
        interval_s=0.01,
        heartbeat_s=0.05,
        on_heartbeat=lambda: beats.append(flushes.calls),
    )
    writer.start()
    await eventually(lambda: flushes.calls >= 2)
    await writer.stop()
    assert beats[:2] == [0, 1]  # each heartbeat came before its flush
    calls = flushes.calls
    await asyncio.sleep(0.2)
    assert flushes.calls == calls  # stopped: no more flushes


class SlowStore:
    """An owner whose write takes a while: pending items move to `stored` once it ends."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.stored: list[int] = []
        self.writing = asyncio.Event()
        self.release = asyncio.Event()

    async def write(self) -> None:
        batch, self.pending = self.pending, []
        self.writing.set()
        await self.release.wait()
        self.stored += batch


async def test_flush_returns_only_once_a_write_in_progress_has_stored_its_rows() -> None:
    # The catalogue's reconnect-storm test saw 384 of 1000 rows after flush(): the task's write
    # had taken the rows, so the caller's flush found nothing and returned before they landed.
    store = SlowStore()
    writer = WriteBehind(store.write, name="test-writer", interval_s=0.01)
    writer.start()
    try:
        store.pending = [1, 2, 3]
        writer.wake()
        await asyncio.wait_for(store.writing.wait(), 5)
        flushed = asyncio.create_task(writer.flush())
        await asyncio.sleep(0.05)
        assert not flushed.done()  # waits for the write in progress
        store.release.set()
        await asyncio.wait_for(flushed, 5)
        assert store.stored == [1, 2, 3]
    finally:
        store.release.set()
        await writer.stop()


async def test_stop_lets_a_write_in_progress_finish() -> None:
    store = SlowStore()
    writer = WriteBehind(store.write, name="test-writer", interval_s=0.01)
    writer.start()
    store.pending = [7]
    writer.wake()
    await asyncio.wait_for(store.writing.wait(), 5)
    stopping = asyncio.create_task(writer.stop())
    await asyncio.sleep(0.05)
    store.release.set()
    await asyncio.wait_for(stopping, 5)
    assert store.stored == [7]
