"""The decoding processes: a recognition model loaded once in each, a bounded queue in front.

Recognition is the costliest stage of a voice turn (Whisper: about 0.35 s of CPU per
utterance), so it runs in `workers` processes of its own, at a lower priority (`nice`) than
the bridge: the event loop that serves every other device keeps its latency while the
recognizer is busy, and the model's memory stays in those processes (one copy each, loaded
when the bridge starts).

At most `workers` utterances decode at once; up to `queue_max` more wait here, in the bridge,
where waiting is cheap and can be cancelled (a device that spoke again, or left). Past that,
`decode` raises `RecognizerBusy` at once: the device hears an apology, not silence.
"""

import asyncio
import contextlib
import importlib
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from backend.voice.recognition.errors import RecognitionFailed, RecognizerBusy

log = structlog.get_logger("voice.asr")

_EXPECTED_DECODE_S = 0.3  # the first estimate of a decode's time, until one is measured
_EMA = 0.2  # weight of the newest decode in the running estimate


@dataclass(frozen=True, slots=True)
class Decoded:
    """One utterance's text, with how sure the model was where it says: the mean
    log-probability of its tokens and the probability that it heard no speech."""

    text: str
    avg_logprob: float | None = None
    no_speech_prob: float = 0.0
    cpu_s: float = 0.0
    alternatives: tuple[str, ...] = ()  # the engine's next best readings, best first
    # each reading's share of the probability the engine gave all of them: text's, then each
    # alternative's (empty when the engine does not say)
    shares: tuple[float, ...] = ()


class Engine(Protocol):
    """A model loaded in a decoding process."""

    def decode(self, pcm: bytes, prompt: str) -> Decoded:
        """The text of one utterance of 16 kHz PCM16."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """How a decoding process loads its engine: `module:function(*args)`, by name (it is
    imported there, not pickled)."""

    loader: str
    args: tuple[Any, ...] = ()
    name: str = "engine"


# ---- in the decoding process ---------------------------------------------------------------------

_engine: Engine | None = None
_load_error = "the model is not loaded"


ORPHAN_CHECK_S = 1.0  # how often a decoding process checks that the bridge still runs


def _exit_with_the_bridge(bridge_pid: int) -> None:
    """A bridge killed with SIGKILL cannot stop its decoding processes: each one leaves by
    itself once its parent is gone (else it would hold 300 MB, and the bridge's stdout, forever).
    The bridge's pid comes from the bridge: one killed before this process started is gone
    already, and `getppid()` here would name the process that adopted it."""
    while os.getppid() == bridge_pid:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(0)


def _load(spec: EngineSpec, nice: int, bridge_pid: int) -> None:
    """The decoding process's start: follow the bridge's life, lower its priority, load (and
    check) the model. A failure is kept and raised by every call, so the bridge learns why."""
    global _engine, _load_error
    threading.Thread(
        target=_exit_with_the_bridge, args=(bridge_pid,), name="orphan-check", daemon=True
    ).start()
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    module, _, function = spec.loader.partition(":")
    try:
        _engine = getattr(importlib.import_module(module), function)(*spec.args)
    except Exception as exc:
        _load_error = f"{type(exc).__name__}: {exc}"


def _loaded() -> Engine:
    if _engine is None:
        raise RecognitionFailed(f"the recognition model did not load ({_load_error})")
    return _engine


def _ping() -> int:
    _loaded()
    return os.getpid()


def _decode(pcm: bytes, prompt: str) -> Decoded:
    return _loaded().decode(pcm, prompt)


# ---- in the bridge -------------------------------------------------------------------------------


class DecodePool:
    """An engine in `workers` processes behind a bounded queue (see the module docstring)."""

    def __init__(
        self, spec: EngineSpec, *, workers: int = 1, queue_max: int = 8, nice: int = 5
    ) -> None:
        self.spec = spec
        self.workers = workers
        self.queue_max = queue_max
        self.nice = nice
        self._executor: ProcessPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None
        self._ready: asyncio.Future[None] | None = None
        self.waiting = 0  # admitted, not yet decoding
        self.running = 0
        self.decode_s = _EXPECTED_DECODE_S  # running estimate of one decode's wall time
        self.decoded = 0
        self.pids: list[int] = []
        self.failure: str | None = None  # why the model did not load

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the processes; the model loads in each while the bridge goes on starting."""
        loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self.workers)
        self._executor = self._new_executor()
        self._ready = loop.create_task(self._warm(self._executor))

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),  # no fork of a threaded bridge
            initializer=_load,
            initargs=(self.spec, self.nice, os.getpid()),
        )

    async def _warm(self, executor: ProcessPoolExecutor) -> None:
        began = time.perf_counter()
        futures = [asyncio.wrap_future(executor.submit(_ping)) for _ in range(self.workers)]
        try:
            self.pids = sorted(set(await asyncio.gather(*futures)))
        except BrokenProcessPool as exc:
            self.failure = f"the decoding process did not start ({exc})"
        except RecognitionFailed as exc:
            self.failure = str(exc)
        if self.failure is not None:
            log.error("speech recognizer unavailable", engine=self.spec.name, error=self.failure)
            return
        log.info(
            "speech recognizer ready",
            engine=self.spec.name,
            workers=self.workers,
            load_s=round(time.perf_counter() - began, 2),
        )

    async def wait_ready(self) -> None:
        """Until the model has loaded in every process.

        Raises:
            RecognitionFailed: it did not load.
        """
        if self._ready is None:
            self.start()
        assert self._ready is not None
        await asyncio.shield(self._ready)
        if self.failure is not None:
            raise RecognitionFailed(self.failure)

    async def aclose(self) -> None:
        """Stop the processes (a decode in progress is abandoned)."""
        executor, self._executor = self._executor, None
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        if executor is not None:
            await asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True)

    # ---- decoding -----------------------------------------------------------------------------

    def backlog_s(self) -> float:
        """About how long a new utterance would wait before its decode starts."""
        ahead = self.waiting + self.running
        return max(0, ahead - self.workers + 1) * self.decode_s / self.workers

    async def decode(self, pcm: bytes, prompt: str) -> Decoded:
        """Recognize one utterance (16 kHz PCM16).

        Raises:
            RecognizerBusy: `queue_max` utterances already wait.
            RecognitionFailed: the model is not loaded, or its process died (it is restarted
                for the next utterance).
        """
        if self.waiting >= self.queue_max:
            raise RecognizerBusy(f"{self.waiting} utterances are waiting to be recognized")
        await self.wait_ready()
        assert self._slots is not None
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            return await self._run(pcm, prompt)
        finally:
            self.running -= 1
            self._slots.release()

    async def _run(self, pcm: bytes, prompt: str) -> Decoded:
        executor = self._executor
        if executor is None:
            raise RecognitionFailed("the recognizer is closed")
        began = time.perf_counter()
        try:
            decoded = await asyncio.wrap_future(executor.submit(_decode, pcm, prompt))
        except BrokenProcessPool:
            self._restart(executor)
            raise RecognitionFailed("the decoding process stopped; it is being restarted") from None
        self.decoded += 1
        self.decode_s += _EMA * (time.perf_counter() - began - self.decode_s)
        return decoded

    def _restart(self, broken: ProcessPoolExecutor) -> None:
        if self._executor is not broken:
            return  # another decode restarted it already
        log.warning("speech recognizer process died; restarting", engine=self.spec.name)
        broken.shutdown(wait=False, cancel_futures=True)
        self._executor = self._new_executor()
        self.failure = None
        self._ready = asyncio.get_running_loop().create_task(self._warm(self._executor))
