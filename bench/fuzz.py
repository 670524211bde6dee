"""Fuzzing: 100,000 generated inputs per parser of device and API data (hypothesis, generation
phase only), with no exception but the parser's own error allowed out.

The parsers and their properties are `simulator.fuzzing` (the test suite runs them with a few
hundred examples). The firmware's MCP server has its own campaign on CPython and MicroPython
(tests/test_firmware_fuzz.py with `FUZZ_EXAMPLES` / `FUZZ_CORPUS`, and tools/fuzz_firmware_mcp.py
with atheris).
"""

import time
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.strategies import SearchStrategy

from bench.common import bench_main, table, verdict
from bench.report import environment
from simulator import fuzzing

NAME = "fuzz"
FULL = 100_000
QUICK = 300

PARSERS: dict[str, tuple[SearchStrategy[Any], Callable[..., None], bool]] = {
    "device frame decoder (`decode_device_message` + models)": (
        fuzzing.device_frames,
        fuzzing.check_device_frame,
        False,
    ),
    "MCP client `feed` (replies, requests, notifications, batches)": (
        fuzzing.mcp_payloads,
        fuzzing.check_mcp_payload,
        False,
    ),
    "device replies: initialize / tools/call results, tool lists": (
        fuzzing.tool_declarations,
        fuzzing.check_reply_results,
        False,
    ),
    "binary audio framing v1/v2/v3": (fuzzing.audio_frames, fuzzing.check_audio_frame, True),
    "admin API tool-call body": (fuzzing.api_bodies, fuzzing.check_api_body, False),
}


def run_one(strategy: SearchStrategy[Any], check: Callable[..., None], star: bool, n: int) -> int:
    count = 0

    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def property_(value: Any) -> None:
        nonlocal count
        count += 1
        if star:
            check(*value)
        else:
            check(value)

    property_()
    return count


async def run(quick: bool) -> str:
    examples = QUICK if quick else FULL
    rows = []
    failures = 0
    for label, (strategy, check, star) in PARSERS.items():
        began = time.perf_counter()
        try:
            count = run_one(strategy, check, star, examples)
            outcome = "none escaped"
        except Exception as exc:  # a property failed: report it, go on with the others
            count, outcome = 0, f"**{type(exc).__name__}**: {str(exc)[:80]}"
            failures += 1
        rows.append([label, f"{count:,}", f"{time.perf_counter() - began:.1f}", outcome])
    quick_note = " — **quick run**" if quick else ""
    return f"""## Fuzzing the parsers

{environment()}{quick_note}. `python -m bench.fuzz`.

{table(["parser", "inputs", "seconds", "exceptions other than the parser's own"], rows)}

Inputs: deep nesting up to 60,000 levels, integers up to 10^30, NaN and infinities, invalid
UTF-8, every field of every message with a value of a random type, batches. Target: 100,000
inputs per parser, no exception escaping: {verdict(failures == 0 and examples >= FULL)}.
"""


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
