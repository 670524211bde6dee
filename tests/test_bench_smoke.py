"""Each benchmark runs end to end with --quick and writes its report section (no timing checks)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = [  # the longest first (tests/scheduling.py hands them out in this order)
    "voice", "voice_recognition", "mqtt", "fuzz", "sdk_compare", "fleet", "vision", "udp",
    "mcp_servers", "console_page", "console_devices", "mcp_dialin", "tool_call", "hello_ready",
    "disconnect", "chat", "ota", "metrics_overhead", "db_writes",
    # Two `serve` processes at a time, PostgreSQL and Mosquitto (about 50 s alone on 2 cores):
    # run after the parallel phase so it keeps the CPU it needs to finish within the timeout.
    pytest.param("cluster", marks=[pytest.mark.slow, pytest.mark.serial]),
    # Headless Chromium talking hands-free in real time to the embedded voice stack: under the
    # parallel phase's load the fake microphone's next pass can talk over a late answer.
    pytest.param("console_talk", marks=[pytest.mark.slow, pytest.mark.serial]),
]  # fmt: skip
# Benchmarks that report figures against no target (no verdict line), and the words their
# quick run is named by.
NO_VERDICT = {"voice_recognition", "console_talk"}
QUICK_WORDS = {"voice_recognition": "quick: "}


# A hang guard, not a speed check: a quick run takes 10-100 s, and the parallel phase's load can
# more than double that (the voice bench's real-time turns took 120 s once there).
@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", BENCHMARKS)
def test_quick_run_writes_its_section(name: str, tmp_path: Path) -> None:
    report = tmp_path / "benchmarks.md"
    # A stale section of this benchmark and one of another: the run replaces only its own.
    report.write_text(
        f"# Benchmarks\n\n<!-- bench:{name} -->\nstale\n<!-- /bench:{name} -->\n\n"
        "<!-- bench:other -->\nkept\n<!-- /bench:other -->\n"
    )
    env = {**os.environ, "BENCH_REPORT": str(report)}
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=330,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = report.read_text()
    assert "stale" not in text and "kept" in text
    assert text.count(f"<!-- bench:{name} -->") == 1
    assert text.index(f"<!-- bench:{name} -->") < text.index("<!-- bench:other -->")
    section = re.search(rf"<!-- bench:{name} -->(.*?)<!-- /bench:{name} -->", text, re.S)
    assert section is not None, text
    body = section.group(1)
    assert QUICK_WORDS.get(name, "quick run") in body
    # A table with measured numbers ("12.5 ms", "17/27"), and a verdict on the target.
    assert re.search(r"^\| [^|]+ \| \d+(\.\d+)?[ /]", body, re.M), body
    if name not in NO_VERDICT:
        assert "**met**" in body or "**not met**" in body
    assert body.strip() in done.stdout
