"""The runtime file: where a running bridge listens, for the CLI, `simulate` and `demo`.

`serve` writes `<data_dir>/bridge.json` once it listens and removes it when it stops; readers
need nothing but this module (no server code is imported to find a bridge).
"""

import contextlib
import gc
import json
import os
import resource
from pathlib import Path
from typing import Any

RUNTIME_FILE = "bridge.json"


def write_runtime_file(data_dir: Path, info: dict[str, Any]) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), **info}
    (data_dir / RUNTIME_FILE).write_text(json.dumps(record) + "\n")


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
