"""Write one benchmark's results into docs/benchmarks.md, between markers of its own.

Each benchmark owns a section `<!-- bench:NAME -->` … `<!-- /bench:NAME -->`; re-running one
benchmark replaces only its section, so the file always holds the latest run of each.
`BENCH_REPORT=path` writes to another file instead (the smoke tests use a temporary one).
"""

import os
import platform
import re
import sys
from datetime import UTC, datetime
from pathlib import Path

REPORT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
_HEADER = """# Benchmarks

Written by the scripts in `bench/` (`python -m bench.<name>`; `python -m bench.all` runs every
one). This machine is shared and noisy, so each figure is compared with a baseline measured in
the same run, and targets are checked as ratios where the issue sets one.
"""


def environment() -> str:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{now}, Python {sys.version.split()[0]}, {platform.machine()}, {_cpus()} CPUs"


def report_path() -> Path:
    """docs/benchmarks.md, or the file named by BENCH_REPORT."""
    override = os.environ.get("BENCH_REPORT")
    return Path(override) if override else REPORT


def write_section(name: str, markdown: str, path: Path | None = None) -> Path:
    """Replace (or append) the section `name` of the report (or of `path`) with `markdown`."""
    path = path if path is not None else report_path()
    text = path.read_text() if path.exists() else _HEADER
    block = f"<!-- bench:{name} -->\n{markdown.strip()}\n<!-- /bench:{name} -->"
    pattern = re.compile(
        rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S
    )
    text = (
        pattern.sub(lambda _m: block, text)
        if pattern.search(text)
        else f"{text.rstrip()}\n\n{block}\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
