"""Fuzzing the firmware's MCP server (firmware/lib/mcp_server.py) with hypothesis.

`McpServer.handle(text)` must never raise, whatever arrives: every bad input becomes a JSON-RPC
error reply (or no reply), every reply is strict JSON that carries the request's id when the
request had a usable one, and a valid call right after still works. `handle_message` gets the
same treatment with hostile parsed values. On CPython the server runs in this process; for the
MicroPython unix port a corpus generated here is fed to tests/fw/fuzz_corpus.py.

A few hundred examples per test by default, fast; the environment scales it up:
`FUZZ_EXAMPLES=100000` for the CPython tests, `FUZZ_CORPUS=100000` for the MicroPython corpus
(default 2,000 inputs); either one turns pytest-timeout off for this module.
tools/fuzz_firmware_mcp.py is a coverage-guided campaign with atheris, not run here.
"""

import json
import math
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from backend.firmware import find_tool
from simulator.firmware import firmware_module

REPO = Path(__file__).resolve().parents[1]
CORPUS_SCRIPT = REPO / "tests" / "fw" / "fuzz_corpus.py"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
CORPUS_SIZE = int(os.environ.get("FUZZ_CORPUS", "2000"))
# A scaled-up campaign runs for minutes: no pytest-timeout then (0 turns it off).
SCALED = "FUZZ_EXAMPLES" in os.environ or "FUZZ_CORPUS" in os.environ
pytestmark = [pytest.mark.timeout(0)] if SCALED else []
SUMMARY = re.compile(r"^fuzz: (\d+) inputs, (\d+) escapes, (\d+) bad replies, (\d+) broken$", re.M)

mcp_server = firmware_module("mcp_server")
tools_stock = firmware_module("tools_stock")
hal_fake = firmware_module("hal_fake")

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

fuzz_settings = settings(
    max_examples=EXAMPLES,
    deadline=None,  # no timing in unit tests: big inputs are slow, not wrong
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def new_server() -> Any:
    server = mcp_server.McpServer("fuzz-board", "1.0")
    tools_stock.register(server, hal_fake.HalFake())
    return server


SERVER = new_server()  # one server for all examples: state must never get stuck


# ---- strategies ---------------------------------------------------------------------------------

ints = st.one_of(
    st.integers(),
    st.sampled_from([2**31, -(2**31) - 1, 2**53 + 1, 2**63, -(2**63) - 1, 2**64, -(10**300)]),
)
floats = st.floats(allow_nan=True, allow_infinity=True)
strings = st.one_of(
    st.text(st.characters(codec=None, exclude_categories=[]), max_size=40),  # surrogates too
    st.sampled_from(TOOLS + METHODS + ARGUMENT_NAMES + ["", "2.0", "\x00", "\ud800"]),
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
    """`nested(leaf, depth, kind)`, built only inside a test, so that hypothesis prints this
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


# ---- CPython ------------------------------------------------------------------------------------


@fuzz_settings
@given(texts)
@example("[" * 1000)
@example('{"a":' * 5000)
@example('{"jsonrpc":"2.0","id":NaN,"method":"ping"}')
@example('{"jsonrpc":"2.0","id":1e400,"method":"ping"}')
@example('{"jsonrpc":"2.0","id":1,"method":"' + "m" * 100_000 + '"}')
def test_handle_never_raises_on_text(text: str) -> None:
    reply = SERVER.handle(text)
    if reply is not None:
        check_reply(strict_json(reply), parsed_or_missing(text))
    else:
        assert isinstance(parsed_or_missing(text), dict), text[:200]
    check_server_still_works(SERVER)


@fuzz_settings
@given(raw_bytes)
@example(b"\xff\xfe\xfd")
@example(b'{"jsonrpc":"2.0","id":"\xc3\x28","method":"ping"}')
def test_handle_never_raises_on_bytes(data: bytes) -> None:
    reply = SERVER.handle(data)
    if reply is not None:
        check_reply(strict_json(reply), parsed_or_missing(data))
    check_server_still_works(SERVER)


@fuzz_settings
@given(st.one_of(requests(hostile), requests(hostile, valid_looking=True), hostile))
@example({"jsonrpc": "2.0", "id": math.nan, "method": "ping"})
@example(
    {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": DeepValue(1, 50_000, "list")}
)
def test_handle_message_with_hostile_parsed_values(message: Any) -> None:
    message = materialize(message)
    reply = SERVER.handle_message(message)
    assert not isinstance(reply, mcp_server.AsyncCall)  # no async tool is registered
    if reply is not None:
        check_reply(strict_json(json.dumps(reply, allow_nan=False)), message)
    check_server_still_works(SERVER)


@fuzz_settings
@given(requests(text_values, valid_looking=True))
def test_tools_call_with_random_arguments(message: dict[str, Any]) -> None:
    reply = SERVER.handle(to_text(message))
    assert reply is not None
    answer = strict_json(reply)
    check_reply(answer, json.loads(to_text(message)))
    if "error" in answer:  # refused: a stock message, never a crash report
        assert answer["error"]["code"] in (-32602, -32603), answer
    check_server_still_works(SERVER)


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


@pytest.mark.micropython
@pytest.mark.skipif(find_tool("micropython") is None, reason="MicroPython unix port not installed")
def test_micropython_never_raises_on_a_generated_corpus(tmp_path: Path) -> None:
    micropython = find_tool("micropython")
    assert micropython is not None
    corpus = tmp_path / "corpus.txt"
    # The unix port works through the corpus while hypothesis is still generating it; the file
    # keeps it for a rerun: micropython tests/fw/fuzz_corpus.py CORPUS
    process = subprocess.Popen(
        [micropython, str(CORPUS_SCRIPT), "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdin is not None
    written = 0
    with corpus.open("w") as file:

        def emit(line: str) -> None:
            nonlocal written
            file.write(line + "\n")
            process.stdin.write(line + "\n")  # type: ignore[union-attr]
            written += 1

        try:
            generate_corpus(CORPUS_SIZE, emit)
        finally:
            output, _ = process.communicate(timeout=600)
    match = SUMMARY.search(output)
    assert match, f"{corpus}:\n{output[-4000:]}"
    inputs, escapes, bad, broken = map(int, match.groups())
    assert (process.returncode, escapes, bad, broken) == (0, 0, 0, 0), f"{corpus}:\n{output}"
    assert inputs == written >= min(CORPUS_SIZE, 100)
