"""Fuzzing: 100,000 generated inputs per parser of device and API data (hypothesis, generation
phase only), with no exception but the parser's own error allowed out.

The backend's parsers and their properties are `testkit.fuzzing`; the firmware's MCP server
(`McpServer.handle` / `handle_message`) and its properties are `testkit.firmware_fuzzing`, run
in this process on CPython and, for the MicroPython unix port, as a generated corpus streamed to
testkit/firmware_fuzz_corpus.py (that row is skipped without a `micropython` binary). The
test suite runs the same properties with a few hundred examples (tests/test_fuzz_parsers.py,
tests/test_firmware_fuzz.py); tools/fuzz_firmware_mcp.py is a coverage-guided campaign with
atheris.
"""

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.strategies import SearchStrategy

from backend.firmware.tools import find_tool
from bench.common import bench_main, table, verdict
from bench.report import environment
from testkit import firmware_fuzzing, fuzzing, mcp_server_fuzzing

NAME = "fuzz"
FULL = 100_000
QUICK = 100  # proves each parser's run and the table (tests/test_bench_smoke)

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
    "tool argument check (`jsonschema_rs`): any declared schema, any arguments": (
        fuzzing.tool_arguments,
        fuzzing.check_argument_check,
        True,
    ),
    "MQTT 3.1.1 packets (`PacketReader`, fed in 7-byte pieces)": (
        fuzzing.mqtt_streams,
        fuzzing.check_mqtt_stream,
        False,
    ),
    "external MCP servers: dial-in frames, tools/list pages, tools/call results": (
        mcp_server_fuzzing.server_inputs,
        mcp_server_fuzzing.check_server_input,
        True,
    ),
    "firmware MCP server `McpServer.handle` (CPython)": (
        firmware_fuzzing.handle_inputs,
        firmware_fuzzing.check_handle_input,
        True,
    ),
}
MICROPYTHON_ROW = "firmware MCP server on the MicroPython unix port (generated corpus)"


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


def run_micropython(n: int) -> tuple[int, str, bool]:
    """(inputs, outcome, clean) for `n` generated inputs fed to the unix port."""
    with tempfile.TemporaryDirectory(prefix="fuzz-corpus-") as work:
        run = firmware_fuzzing.run_micropython_corpus(n, Path(work) / "corpus.txt")
    if run.clean:
        return run.inputs, "none escaped", True
    return run.inputs, f"**{run.describe()}**", False


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
    skipped = find_tool("micropython") is None
    if skipped:
        rows.append(
            [MICROPYTHON_ROW, "—", "—", "skipped: no `micropython` binary (`firmware` extra)"]
        )
    else:
        began = time.perf_counter()
        try:
            count, outcome, clean = run_micropython(examples)
        except Exception as exc:  # e.g. the unix port hung: report it like a failed property
            count, outcome, clean = 0, f"**{type(exc).__name__}**: {str(exc)[:80]}", False
        failures += not clean
        rows.append([MICROPYTHON_ROW, f"{count:,}", f"{time.perf_counter() - began:.1f}", outcome])
    quick_note = " — **quick run**" if quick else ""
    return f"""## Fuzzing the parsers

{environment()}{quick_note}. `python -m bench.fuzz`.

{table(["parser", "inputs", "seconds", "exceptions other than the parser's own"], rows)}

Inputs: deep nesting up to 60,000 levels, integers up to 10^30, NaN and infinities, invalid
UTF-8, every field of every message with a value of a random type, batches. The firmware's MCP
server gets JSON-RPC requests with every field right, absent or hostile, mutated and raw bytes,
nesting up to 20,000 levels, integers of 5,000 digits, lone surrogates; each reply must be a
strict JSON-RPC object with the request's id, and a valid call right after must still work.
Target: 100,000 inputs per parser, no exception escaping:
{verdict(failures == 0 and examples >= FULL and not skipped)}.
"""


def main(argv: list[str] | None = None) -> None:
    bench_main(NAME, __doc__ or NAME, run, argv)


if __name__ == "__main__":
    main()
