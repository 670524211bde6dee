"""The runtime file: where a running bridge listens, for the CLI, `simulate` and `demo`; and the
data directory's lock, which keeps a second bridge out of it.

`serve` writes `<data_dir>/bridge.json` once it listens and removes it when it stops; readers
need nothing but this module (no server code is imported to find a bridge).
"""

import contextlib
import errno
import fcntl
import gc
import json
import os
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from backend.errors import BridgeError

RUNTIME_FILE = "bridge.json"
LOCK_FILE = "bridge.lock"


class DataDirBusy(BridgeError):
    """Another live process holds the data directory's lock."""


class DataDirUnusable(BridgeError):
    """The data directory (or a file in it) cannot be created, read or written."""


def data_dir_error(data_dir: Path, exc: OSError) -> DataDirUnusable:
    """An OSError about a path in the data directory, as one line that says so and how to move
    it (raw errno text names neither)."""
    reason = exc.strerror or str(exc)
    if data_dir.exists() and not data_dir.is_dir():
        reason = "not a directory"
    what = "" if exc.filename in (None, str(data_dir)) else f"{exc.filename}: "
    return DataDirUnusable(
        f"data directory {data_dir}: {what}{reason} (use another one with --data-dir or "
        "BRIDGE_DATA_DIR)"
    )


@contextlib.contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Hold `<data_dir>/bridge.lock` (flock) while the block runs: two bridges on one directory
    would write one database and remove each other's runtime file. The kernel releases the lock
    when the process dies, so a crash leaves nothing stale; the file itself stays (removing it
    would let a third process lock a different inode)."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a bridge.lock symlink must not make us truncate the file it points at.
        fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise data_dir_error(data_dir, exc) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise data_dir_error(data_dir, exc) from None
            raise DataDirBusy(
                f"data directory {data_dir} is in use by another bridge ({_lock_holder(fd)}): "
                "stop it, or give this one its own directory with --data-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _lock_holder(fd: int) -> str:
    """`pid N` of the process that holds the lock, as it wrote it in the file."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"pid {text}" if text.isdigit() else "pid unknown"


def write_runtime_file(data_dir: Path, info: dict[str, Any]) -> None:
    """Write `bridge.json` (this process's pid and where it listens) for the CLI to find it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), **info}
    # Written aside then renamed: a CLI reading meanwhile sees the old file or the new, never
    # an empty one.
    staged = data_dir / f".{RUNTIME_FILE}.{os.getpid()}"
    staged.write_text(json.dumps(record) + "\n")
    os.replace(staged, data_dir / RUNTIME_FILE)


def read_runtime_file(data_dir: Path) -> dict[str, Any] | None:
    """Where a bridge on this machine listens, or None when none has written its file."""
    try:
        info = json.loads((data_dir / RUNTIME_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def remove_runtime_file(data_dir: Path) -> None:
    """Remove the file if this process wrote it (another bridge may have replaced it)."""
    with contextlib.suppress(OSError):
        info = read_runtime_file(data_dir)
        if info is not None and info.get("pid") == os.getpid():
            (data_dir / RUNTIME_FILE).unlink()


def tune_gc_for_many_devices() -> None:
    """Garbage-collector settings for a long-running bridge process.

    Every device holds a few hundred long-lived objects (its connection, session, MCP client),
    and CPython's default first-generation threshold (700 allocations) makes the collector
    traverse them again and again while thousands of devices connect: measured here, it was
    half of the bridge's CPU time for a fleet of 10,000. Freezing what exists at start moves it
    out of every collection, and a larger first threshold makes collections rarer; reference
    counting still frees almost everything at once.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft open-file limit to the hard one (each device link is one descriptor);
    returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return soft, hard
    return soft, soft
