"""Child processes whose output is collected line by line as it arrives: the firmware under the
MicroPython unix port, or a bridge. Tests, benchmarks and `testkit.firmware_memory` use them.
"""

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

WAIT_S = 30.0  # how long a WatchedProcess waits for what it is told to expect


class WatchedProcess:
    """A subprocess (the firmware, or a bridge) whose output lines are collected as they arrive.

    Its stdin is empty unless `piped_stdin`, which lets `type_line` feed it lines.
    """

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path | None = None,
        *,
        piped_stdin: bool = False,
    ) -> None:
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.piped_stdin = piped_stdin
        self.lines: list[str] = []
        self.process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv,
            env=self.env,
            cwd=self.cwd,
            stdin=asyncio.subprocess.PIPE if self.piped_stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self._reader = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def wait_for(
        self, check: Callable[[], bool], what: str, timeout_s: float = WAIT_S
    ) -> None:
        """Poll `check` until it holds; RuntimeError with the output if the process ends first."""
        deadline = time.monotonic() + timeout_s
        while not check():
            if not self.running:
                raise RuntimeError(f"process exited before {what}:\n{self.output}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:g} s:\n{self.output}")
            await asyncio.sleep(0.01)

    async def wait_for_line(self, text: str, timeout_s: float = WAIT_S) -> None:
        await self.wait_for(lambda: text in self.lines, repr(text), timeout_s)

    async def type_line(self, text: str) -> None:
        """Write one line to its stdin (started with `piped_stdin`)."""
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(text.encode() + b"\n")
        await self.process.stdin.drain()

    async def stop(self) -> None:
        """Terminate (kill if it lingers) and collect the rest of the output."""
        if self.running:
            assert self.process is not None
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
        await self._finish()

    async def kill(self) -> None:
        """SIGKILL: no shutdown code runs; the kernel closes the process's sockets."""
        if self.running:
            assert self.process is not None
            self.process.kill()
        await self._finish()

    async def _finish(self) -> None:
        if self.process is not None:
            await self.process.wait()
        if self._reader is not None:
            await self._reader
