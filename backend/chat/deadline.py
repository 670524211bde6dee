"""One deadline for a whole turn, with one timer.

`asyncio.timeout` around each awaited step would do, at the price of a timer per step (a turn
awaits ~27 model items: 0.3 ms a turn, a third of the pipeline's own cost). Here the turn's one
timer cancels the task only while it is inside `run`; a deadline that passes between steps is
seen at the next one. A timeout scope cannot span the turn itself: the turn is an async
generator, and a cancellation landing while its consumer is elsewhere (writing to a socket)
would escape it.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

_T = TypeVar("_T")


class Deadline:
    """The deadline of one turn (see the module docstring); `expired` makes the error it raises."""

    def __init__(self, timeout_s: float, expired: Callable[[], Exception]) -> None:
        loop = asyncio.get_running_loop()
        self._expired_error = expired
        self._task: asyncio.Task[object] | None = None
        self.expired = False
        self._handle = loop.call_at(loop.time() + timeout_s, self._fire)

    def _fire(self) -> None:
        self.expired = True
        if self._task is not None:
            self._task.cancel()

    async def run(self, step: Awaitable[_T]) -> _T:
        """The step's result, or the `expired` error once the deadline has passed."""
        if self.expired:
            close = getattr(step, "close", None)
            if close is not None:
                close()  # a coroutine never awaited
            raise self._expired_error()
        task = asyncio.current_task()
        self._task = task
        try:
            return await step
        except asyncio.CancelledError:
            if self.expired and task is not None and task.uncancel() == 0:
                raise self._expired_error() from None
            raise
        finally:
            self._task = None

    def close(self) -> None:
        """Cancel the timer (the turn is over)."""
        self._handle.cancel()
