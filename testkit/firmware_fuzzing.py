"""Generated hostile input for the firmware's MCP server (firmware/lib/mcp_server.py) and the
properties it must keep, on CPython and on the MicroPython unix port.

`McpServer.handle(text)` must never raise, whatever arrives: every bad input becomes a JSON-RPC
error reply (or no reply), every reply is strict JSON that carries the request's id when the
request had a usable one, and a valid call right after still works. `handle_message` gets the
same treatment with hostile parsed values. On CPython the server runs in this process
(`check_text`, `check_bytes`, `check_message`, `check_tools_call`); for the unix port
`run_micropython_corpus` generates a corpus here and streams it to firmware_fuzz_corpus.py
(beside this module), which checks the same properties inside MicroPython.

Used by tests/test_firmware_fuzz.py (a few hundred examples per test) and bench/fuzz.py
(100,000 inputs per runtime, with timings). Needs hypothesis (the `dev` extra).
"""

import json
import math
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from backend.firmware.source import firmware_dir
from backend.firmware.tools import micropython_argv, micropython_env
from simulator.firmware import firmware_module

CORPUS_SCRIPT = Path(__file__).resolve().parent / "firmware_fuzz_corpus.py"
# The unix port's heap for the corpus run: inputs up to 64 KB, as hex lines, in a heap that
# fragments over 10,000 of them (the default 2 MB ran out once, allocating 176 KB).
CORPUS_HEAP_KB = 16384
SKIPPED = re.compile(r"^fuzz: (\d+) inputs over \d+ bytes skipped$", re.M)
SUMMARY = re.compile(r"^fuzz: (\d+) inputs, (\d+) escapes, (\d+) bad replies, (\d+) broken$", re.M)

TOOLS = [
    "self.get_device_status",
    "self.audio_speaker.set_volume",
    "self.screen.set_brightness",
    "self.screen.set_theme",
    "self.led.set",
    "self.get_system_info",
    "self.reboot",
]
ARGUMENT_NAMES = ["volume", "brightness", "theme", "on"]
METHODS = ["initialize", "tools/list", "tools/call", "ping", "notifications/initialized"]
ERROR_CODES = {-32700, -32600, -32601, -32602, -32603}
CHECK_CALL = (
    '{"jsonrpc":"2.0","id":"check","method":"tools/call",'
    '"params":{"name":"self.audio_speaker.set_volume","arguments":{"volume":42}}}'
)


def new_server() -> Any:
    """A firmware McpServer with the stock tools on the fake HAL."""
    mcp_server = firmware_module("mcp_server")
    tools_stock = firmware_module("tools_stock")
    hal_fake = firmware_module("hal_fake")
    server = mcp_server.McpServer("fuzz-board", "1.0")
    tools_stock.register(server, hal_fake.HalFake())
    return server


@cache
def shared_server() -> Any:
    """One server for every input of a run: its state must never get stuck."""
    return new_server()


# ---- strategies ---------------------------------------------------------------------------------

ints = st.one_of(
    st.integers(),
    st.sampled_from([2**31, -(2**31) - 1, 2**53 + 1, 2**63, -(2**63) - 1, 2**64, -(10**300)]),
)
floats = st.floats(allow_nan=True, allow_infinity=True)
strings = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=[]), max_size=40),  # surrogates too
    st.sampled_from([*TOOLS, *METHODS, *ARGUMENT_NAMES, "", "2.0", "\x00", "\ud800"]),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, strings)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(strings, st.sampled_from(ARGUMENT_NAMES)), inner, max_size=5),
    ),
    max_leaves=8,
)
# Few and big: long strings and ints of up to 1,000 digits.
big_scalars = st.one_of(
    st.integers(min_value=1, max_value=10_000).map(lambda n: "x" * n),
    st.integers(min_value=-(10**1000), max_value=10**1000),
)


def nested(value: Any, depth: int, kind: str) -> Any:
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


class DeepValue:
    """`nested(leaf, depth, kind)`, built only inside a check, so that hypothesis prints this
    rather than a value deeper than its printer (or CPython's json.dumps) can go."""

    def __init__(self, leaf: Any, depth: int, kind: str) -> None:
        self.leaf, self.depth, self.kind = leaf, depth, kind

    def __repr__(self) -> str:
        return f"nested({self.leaf!r}, {self.depth}, {self.kind!r})"


def materialize(value: Any) -> Any:
    if isinstance(value, DeepValue):
        return nested(value.leaf, value.depth, value.kind)
    if isinstance(value, list):
        return [materialize(item) for item in value]
    if isinstance(value, dict):
        return {key: materialize(item) for key, item in value.items()}
    return value


deep_values = st.builds(
    DeepValue,
    scalars,
    st.integers(min_value=1, max_value=20_000),
    st.sampled_from(["list", "dict"]),
)
text_values = st.one_of(json_values, big_scalars)  # what JSON text from CPython can carry
hostile = st.one_of(json_values, big_scalars, deep_values)
MISSING = object()  # stands for "not JSON" where a parsed request is expected


def requests(
    values: st.SearchStrategy[Any] = json_values, *, valid_looking: bool = False
) -> st.SearchStrategy[dict[str, Any]]:
    """JSON-RPC request objects: each field right, absent or any of `values` (`valid_looking`:
    a tools/call with every field right but the tool name and arguments)."""

    def field(right: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return right if valid_looking else st.one_of(right, values)

    name = st.one_of(st.sampled_from(TOOLS), values)
    arguments = st.one_of(
        st.dictionaries(st.sampled_from(ARGUMENT_NAMES), values, max_size=4), values
    )
    params: st.SearchStrategy[dict[str, Any]]
    if valid_looking:
        params = st.fixed_dictionaries({"name": name, "arguments": arguments})
    else:
        optional = {
            "name": name,
            "arguments": arguments,
            "cursor": st.one_of(st.sampled_from(TOOLS), values),
            "withUserTools": st.one_of(st.booleans(), values),
            "capabilities": values,
        }
        params = st.fixed_dictionaries({}, optional=optional)
    fields = {
        "jsonrpc": field(st.just("2.0")),
        "id": field(st.one_of(st.integers(), st.text(max_size=8))),
        "method": field(st.sampled_from(["tools/call"] if valid_looking else METHODS)),
        "params": field(params),
    }
    core = (
        st.fixed_dictionaries(fields)
        if valid_looking
        else st.fixed_dictionaries({}, optional=fields)
    )
    extra = st.dictionaries(strings, values, max_size=2)
    return st.builds(lambda extra, core: {**extra, **core}, extra, core)


def to_text(value: Any) -> str:
    """JSON text as a peer could send it (NaN/Infinity too: CPython's parser takes them)."""
    return json.dumps(value, ensure_ascii=False)


def mutated(text: str, edits: list[tuple[int, str]]) -> str:
    for position, replacement in edits:
        cut = position % (len(text) + 1)
        text = text[:cut] + replacement + text[cut + 1 :]
    return text


def deep_text(depth: int, kind: str, closed: bool) -> str:
    if kind == "list":
        return "[" * depth + ("]" * depth if closed else "")
    return '{"a":' * depth + ("1" + "}" * depth if closed else "")


deep_texts = st.builds(
    deep_text,
    st.integers(min_value=1, max_value=10_000),
    st.sampled_from(["list", "dict"]),
    st.booleans(),
)
number_texts = st.builds(
    lambda digits, where: where.replace("N", digits),
    st.one_of(
        st.integers(min_value=1, max_value=5000).map(lambda n: "9" * n),  # CPython: 4,300 at most
        st.sampled_from(["1e400", "-1e400", "NaN", "Infinity", "-Infinity", "1e-400", "-0"]),
    ),
    st.sampled_from(
        [
            '{"jsonrpc":"2.0","id":N,"method":"ping"}',
            '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":'
            '"self.audio_speaker.set_volume","arguments":{"volume":N}}}',
        ]
    ),
)
texts = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=[])),
    requests(text_values).map(to_text),
    requests(text_values, valid_looking=True).map(to_text),
    st.builds(
        mutated,
        requests(valid_looking=True).map(to_text),
        st.lists(st.tuples(st.integers(min_value=0), st.text(max_size=2)), max_size=4),
    ),
    deep_texts,
    number_texts,
    st.sampled_from(["", " ", "null", "[]", "{}", "[{}]", '"text"', "1", "true", "{" * 3]),
)
raw_bytes = st.one_of(
    st.binary(),
    requests().map(lambda message: to_text(message).encode("utf-8", "surrogatepass")),
    st.builds(
        lambda junk, at: CHECK_CALL.encode()[:at] + junk + CHECK_CALL.encode()[at:],
        st.binary(min_size=1),
        st.integers(min_value=0, max_value=len(CHECK_CALL)),
    ),
)
hostile_messages = st.one_of(requests(hostile), requests(hostile, valid_looking=True), hostile)
tools_calls = requests(text_values, valid_looking=True)


# ---- checks -------------------------------------------------------------------------------------


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"{constant} in a reply: not JSON")

    return json.loads(text, parse_constant=refuse)


def usable_id(request: Any) -> tuple[bool, Any]:
    """(True, id) when the request is an object with an id a reply can carry."""
    if not isinstance(request, dict) or "id" not in request:
        return False, None
    value = request["id"]
    if isinstance(value, bool):
        return False, None
    if isinstance(value, float) and not math.isfinite(value):
        return False, None
    return isinstance(value, (str, int, float)), value


def check_reply(reply: Any, request: Any) -> None:
    """A well-formed JSON-RPC reply to `request` (a parsed value, or MISSING if not JSON)."""
    assert isinstance(reply, dict), reply
    assert reply["jsonrpc"] == "2.0", reply
    assert ("result" in reply) != ("error" in reply), reply
    if "error" in reply:
        assert reply["error"]["code"] in ERROR_CODES, reply
        assert isinstance(reply["error"]["message"], str), reply
    if request is MISSING:
        assert reply["id"] is None and reply["error"]["code"] in (-32700, -32603), reply
        return
    usable, request_id = usable_id(request)
    if usable:
        assert reply["id"] == request_id, (reply, request_id)
    else:
        assert reply["id"] is None, reply
    if isinstance(request, dict) and "id" not in request:
        raise AssertionError(f"a reply to a notification: {reply}")


def check_server_still_works(server: Any) -> None:
    reply = strict_json(server.handle(CHECK_CALL))
    assert reply["id"] == "check" and reply["result"]["content"][0]["text"] == "true", reply


def parsed_or_missing(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return MISSING


def check_text(server: Any, text: str) -> None:
    """`handle(text)`: a proper reply, or none for a notification; the server still works."""
    reply = server.handle(text)
    if reply is not None:
        check_reply(strict_json(reply), parsed_or_missing(text))
    else:
        assert isinstance(parsed_or_missing(text), dict), text[:200]
    check_server_still_works(server)


def check_bytes(server: Any, data: bytes) -> None:
    """`handle(bytes)`, invalid UTF-8 included: a proper reply or none; the server still works."""
    reply = server.handle(data)
    if reply is not None:
        check_reply(strict_json(reply), parsed_or_missing(data))
    check_server_still_works(server)


def check_message(server: Any, message: Any) -> None:
    """`handle_message(value)` with a hostile parsed value: a reply that serialises to strict
    JSON, or none; the server still works."""
    message = materialize(message)
    reply = server.handle_message(message)
    assert not isinstance(reply, firmware_module("mcp_server").AsyncCall)  # no async tool here
    if reply is not None:
        check_reply(strict_json(json.dumps(reply, allow_nan=False)), message)
    check_server_still_works(server)


def check_tools_call(server: Any, message: dict[str, Any]) -> None:
    """A tools/call right but for the tool name and arguments: an answer or a stock refusal."""
    reply = server.handle(to_text(message))
    assert reply is not None
    answer = strict_json(reply)
    check_reply(answer, json.loads(to_text(message)))
    if "error" in answer:  # refused: a stock message, never a crash report
        assert answer["error"]["code"] in (-32602, -32603), answer
    check_server_still_works(server)


# Every CPython check in one stream, for a campaign over all of them (bench/fuzz.py).
CHECKS: dict[str, Callable[[Any, Any], None]] = {
    "text": check_text,
    "bytes": check_bytes,
    "message": check_message,
    "tools/call": check_tools_call,
}
handle_inputs = st.one_of(
    texts.map(lambda value: ("text", value)),
    raw_bytes.map(lambda value: ("bytes", value)),
    hostile_messages.map(lambda value: ("message", value)),
    tools_calls.map(lambda value: ("tools/call", value)),
)


def check_handle_input(kind: str, value: Any) -> None:
    """One input of `handle_inputs`, through the check of its kind, on `shared_server()`."""
    CHECKS[kind](shared_server(), value)


# ---- MicroPython --------------------------------------------------------------------------------


def generate_corpus(size: int, emit: Callable[[str], None]) -> None:
    """`size` inputs as lines `t <hex>` (text, UTF-8 with surrogates kept) or `b <hex>` (bytes)."""

    @settings(
        max_examples=size,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(texts, raw_bytes))
    def collect(value: str | bytes) -> None:
        if isinstance(value, str):
            emit("t " + value.encode("utf-8", "surrogatepass").hex())
        else:
            emit("b " + value.hex())

    collect()


@dataclass(frozen=True, slots=True)
class CorpusRun:
    """What the unix port made of a generated corpus."""

    corpus: Path  # kept for a rerun: micropython testkit/firmware_fuzz_corpus.py CORPUS
    written: int  # inputs generated and sent
    returncode: int
    output: str
    summary: tuple[int, int, int, int] | None  # inputs, escapes, bad replies, broken

    @property
    def inputs(self) -> int:
        return self.summary[0] if self.summary else 0

    @property
    def clean(self) -> bool:
        """Every input handled: no escape, no bad reply, the server never broken."""
        return (
            self.returncode == 0
            and self.summary is not None
            and self.summary[1:] == (0, 0, 0)
            and self.inputs + self.skipped == self.written
        )

    @property
    def skipped(self) -> int:
        """Inputs longer than the firmware's transports take, not fed (the harness says so)."""
        match = SKIPPED.search(self.output)
        return int(match[1]) if match else 0

    def describe(self) -> str:
        """`N inputs, E escapes, B bad replies, K broken`, or why there is no such line."""
        if self.summary is None:
            return f"no summary (exit {self.returncode}): {self.output[-200:].strip()!r}"
        inputs, escapes, bad, broken = self.summary
        return f"{inputs:,} inputs, {escapes} escapes, {bad} bad replies, {broken} broken"


def run_micropython_corpus(size: int, corpus: Path, *, timeout: float = 600) -> CorpusRun:
    """Generate `size` inputs into the file `corpus` and feed them, as they are generated, to
    the firmware's McpServer on the MicroPython unix port; ToolNotFound if it is missing. A
    unix port that dies early leaves no summary (`CorpusRun.describe` shows its output)."""
    process = subprocess.Popen(
        micropython_argv(CORPUS_SCRIPT, "-", heap_kb=CORPUS_HEAP_KB),
        env=micropython_env(firmware_dir() / "lib"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    stdin = process.stdin
    assert stdin is not None
    written = 0
    with corpus.open("w") as file:

        def emit(line: str) -> None:
            nonlocal written
            file.write(line + "\n")
            stdin.write(line + "\n")
            written += 1

        try:
            generate_corpus(size, emit)
        except BrokenPipeError:  # the unix port stopped reading: its output says why
            pass
        finally:
            output, _ = process.communicate(timeout=timeout)
    match = SUMMARY.search(output)
    summary = (int(match[1]), int(match[2]), int(match[3]), int(match[4])) if match else None
    return CorpusRun(corpus, written, process.returncode, output, summary)
