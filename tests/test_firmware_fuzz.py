"""Fuzzing the firmware's MCP server (firmware/lib/mcp_server.py) with hypothesis.

`McpServer.handle(text)` must never raise, whatever arrives: every bad input becomes a JSON-RPC
error reply (or no reply), every reply is strict JSON that carries the request's id when the
request had a usable one, and a valid call right after still works. `handle_message` gets the
same treatment with hostile parsed values. On CPython the server runs in this process; for the
MicroPython unix port a corpus generated here is fed to testkit/firmware_fuzz_corpus.py. The
strategies and checks are `testkit.firmware_fuzzing`, shared with bench/fuzz.py (which runs
100,000 inputs on each runtime).

A few hundred examples per test by default, fast; the environment scales it up:
`FUZZ_EXAMPLES=100000` for the CPython tests, `FUZZ_CORPUS=100000` for the MicroPython corpus
(default 2,000 inputs); either one turns pytest-timeout off for this module.
tools/fuzz_firmware_mcp.py is a coverage-guided campaign with atheris, not run here.
"""

import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings

from backend.firmware import find_tool
from backend.firmware.source import firmware_dir
from backend.firmware.tools import micropython_argv, micropython_env
from testkit.firmware_fuzzing import (
    CORPUS_SCRIPT,
    DeepValue,
    check_bytes,
    check_message,
    check_text,
    check_tools_call,
    hostile_messages,
    new_server,
    raw_bytes,
    run_micropython_corpus,
    texts,
    tools_calls,
)

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
CORPUS_SIZE = int(os.environ.get("FUZZ_CORPUS", "2000"))
# A scaled-up campaign runs for minutes: no pytest-timeout then (0 turns it off).
SCALED = "FUZZ_EXAMPLES" in os.environ or "FUZZ_CORPUS" in os.environ
pytestmark = [pytest.mark.timeout(0)] if SCALED else []

fuzz_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,  # no timing in unit tests: big inputs are slow, not wrong
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SERVER = new_server()  # one server for all examples: state must never get stuck


# ---- CPython ------------------------------------------------------------------------------------


@fuzz_settings
@given(texts)
@example("[" * 1000)
@example('{"a":' * 5000)
@example('{"jsonrpc":"2.0","id":NaN,"method":"ping"}')
@example('{"jsonrpc":"2.0","id":1e400,"method":"ping"}')
@example('{"jsonrpc":"2.0","id":1,"method":"' + "m" * 100_000 + '"}')
def test_handle_never_raises_on_text(text: str) -> None:
    check_text(SERVER, text)


@fuzz_settings
@given(raw_bytes)
@example(b"\xff\xfe\xfd")
@example(b'{"jsonrpc":"2.0","id":"\xc3\x28","method":"ping"}')
def test_handle_never_raises_on_bytes(data: bytes) -> None:
    check_bytes(SERVER, data)


@fuzz_settings
@given(hostile_messages)
@example({"jsonrpc": "2.0", "id": math.nan, "method": "ping"})
@example(
    {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": DeepValue(1, 50_000, "list")}
)
def test_handle_message_with_hostile_parsed_values(message: Any) -> None:
    check_message(SERVER, message)


@fuzz_settings
@given(tools_calls)
def test_tools_call_with_random_arguments(message: dict[str, Any]) -> None:
    check_tools_call(SERVER, message)


# ---- MicroPython --------------------------------------------------------------------------------


@pytest.mark.micropython
@pytest.mark.skipif(find_tool("micropython") is None, reason="MicroPython unix port not installed")
def test_micropython_never_raises_on_a_generated_corpus(tmp_path: Path) -> None:
    # The unix port works through the corpus while hypothesis is still generating it; the file
    # keeps it for a rerun: micropython testkit/firmware_fuzz_corpus.py CORPUS
    run = run_micropython_corpus(CORPUS_SIZE, tmp_path / "corpus.txt")
    assert run.summary, f"{run.corpus}:\n{run.output[-4000:]}"
    assert run.clean, f"{run.corpus}: {run.describe()}\n{run.output}"
    assert run.inputs + run.skipped == run.written >= min(CORPUS_SIZE, 100)


@pytest.mark.micropython
@pytest.mark.skipif(find_tool("micropython") is None, reason="MicroPython unix port not installed")
def test_the_harness_skips_inputs_no_transport_would_deliver(tmp_path: Path) -> None:
    """An input over 64 KB (the firmware's WebSocket limit) is counted, not held in the heap:
    a 176 KB line once ran the unix port out of memory in the harness, not in the firmware."""
    ping = b'{"jsonrpc":"2.0","id":1,"method":"ping"}'.hex()
    huge = ('{"a":"' + "x" * 150_000 + '"}').encode().hex()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(f"t {ping}\nt {huge}\nb 00ff\n")
    done = subprocess.run(
        micropython_argv(CORPUS_SCRIPT, str(corpus)),
        env=micropython_env(firmware_dir() / "lib"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fuzz: 1 inputs over 65536 bytes skipped" in done.stdout
    assert "fuzz: 2 inputs, 0 escapes, 0 bad replies, 0 broken" in done.stdout
