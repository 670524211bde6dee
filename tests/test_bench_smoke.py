"""Each benchmark runs end to end with --quick and writes its report section (no timing checks)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = ["tool_call", "sdk_compare", "hello_ready", "fleet", "disconnect", "udp"]


@pytest.mark.parametrize("name", BENCHMARKS)
def test_quick_run_writes_its_section(name: str, tmp_path: Path) -> None:
    report = tmp_path / "benchmarks.md"
    env = {**os.environ, "BENCH_REPORT": str(report)}
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", "--quick"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = report.read_text()
    section = re.search(rf"<!-- bench:{name} -->(.*?)<!-- /bench:{name} -->", text, re.S)
    assert section is not None, text
    body = section.group(1)
    assert "quick run" in body
    # A table with measured numbers, and a verdict on the target.
    assert re.search(r"^\| [^|]+ \| \d+(\.\d+)? ", body, re.M), body
    assert "**met**" in body or "**not met**" in body
    assert body.strip() in done.stdout


def test_sections_are_replaced_not_appended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.report import write_section

    monkeypatch.setenv("BENCH_REPORT", str(tmp_path / "report.md"))
    write_section("one", "first")
    write_section("two", "second")
    path = write_section("one", "third")
    text = path.read_text()
    assert path == tmp_path / "report.md"
    assert "third" in text and "second" in text and "first" not in text
    assert text.index("third") < text.index("second")
