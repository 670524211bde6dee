"""Coverage-guided fuzzing of the firmware's MCP server with atheris (libFuzzer). Not run in CI.

    pip install -e '.[fuzz]'                          # atheris, an optional extra
    python tools/fuzz_firmware_mcp.py                 # until stopped (Ctrl-C), or a finding
    python tools/fuzz_firmware_mcp.py -max_total_time=600 -jobs=2
    python tools/fuzz_firmware_mcp.py crash-<sha1>    # replay one finding

firmware/lib/mcp_server.py (with tools_stock and hal_fake, instrumented for coverage) gets each
input as bytes and, if it is UTF-8, as text. A finding is: an exception escaping
`McpServer.handle`, a reply that is not a strict JSON-RPC object with the request's id (when
that id is usable), or a valid call right after that no longer works. libFuzzer then writes the
input to `crash-<sha1>` in the current folder and stops.

Without a corpus folder on the command line it uses build/fuzz-mcp-corpus/, seeded with a few
valid requests; unless given, it adds `-dict=build/fuzz-mcp.dict` (JSON-RPC words, NaN,
Infinity, brackets that nest) and `-max_len=65536` (the firmware's largest frame). Other
arguments are libFuzzer flags (`-help=1` lists them). The hypothesis tests
in tests/test_firmware_fuzz.py check the same properties on every CI run; this is the long
campaign for a developer's machine.
"""

import json
import math
import sys
from pathlib import Path
from typing import Any

import atheris  # type: ignore[import-untyped]

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO / "build" / "fuzz-mcp-corpus"
DICTIONARY = REPO / "build" / "fuzz-mcp.dict"
MAX_LEN = 65536
WORDS = [
    '"jsonrpc":"2.0"',
    '"id":',
    '"method":',
    '"params":',
    '"name":',
    '"arguments":',
    '"cursor":',
    '"withUserTools":true',
    "tools/call",
    "tools/list",
    "initialize",
    "notifications/",
    "self.audio_speaker.set_volume",
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "99999999999999999999",
    "\\ud800",
    "[[[[[[[[[[[[[[[[",
    '{"a":{"a":{"a":{"a":',
    "null",
    "true",
]
SEEDS = [
    '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2024-11-05"}}',
    '{"jsonrpc":"2.0","id":2,"method":"tools/list","params":{"withUserTools":true}}',
    '{"jsonrpc":"2.0","id":3,"method":"tools/list","params":{"cursor":"self.led.set"}}',
    '{"jsonrpc":"2.0","id":"a","method":"tools/call",'
    '"params":{"name":"self.led.set","arguments":{"on":true,"brightness":30}}}',
    '{"jsonrpc":"2.0","id":4,"method":"tools/call",'
    '"params":{"name":"self.screen.set_theme","arguments":{"theme":"dark"}}}',
    '{"jsonrpc":"2.0","method":"notifications/initialized"}',
    '{"jsonrpc":"2.0","id":5,"method":"ping"}',
]
CHECK_CALL = (
    '{"jsonrpc":"2.0","id":"check","method":"tools/call",'
    '"params":{"name":"self.audio_speaker.set_volume","arguments":{"volume":42}}}'
)
ERROR_CODES = {-32700, -32600, -32601, -32602, -32603}

sys.path.insert(0, str(REPO / "firmware" / "lib"))
with atheris.instrument_imports():
    import hal_fake  # type: ignore[import-not-found]
    import mcp_server  # type: ignore[import-not-found]
    import tools_stock  # type: ignore[import-not-found]

SERVER = mcp_server.McpServer("fuzz-board", "1.0")
tools_stock.register(SERVER, hal_fake.HalFake())


class Finding(AssertionError):
    """What the fuzzer is looking for."""


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise Finding(f"{constant} in a reply")

    return json.loads(text, parse_constant=refuse)


def _usable_id(request: Any) -> tuple[bool, Any]:
    if not isinstance(request, dict) or "id" not in request:
        return False, None
    value = request["id"]
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        return False, None
    return isinstance(value, (str, int, float)), value


def _check(text: str | bytes) -> None:
    reply = SERVER.handle(text)  # an exception here is a finding as it stands
    try:
        request = json.loads(text)
    except (ValueError, RecursionError):
        request = None
    if reply is None:
        if not isinstance(request, dict):
            raise Finding(f"no reply to {text[:200]!r}")
        return
    answer = _strict_json(reply)
    if not isinstance(answer, dict) or answer.get("jsonrpc") != "2.0":
        raise Finding(f"not a JSON-RPC reply: {reply[:200]}")
    if ("result" in answer) == ("error" in answer):
        raise Finding(f"needs exactly one of result and error: {reply[:200]}")
    if "error" in answer and answer["error"].get("code") not in ERROR_CODES:
        raise Finding(f"unknown error code: {reply[:200]}")
    usable, request_id = _usable_id(request)
    if answer.get("id") != (request_id if usable else None):
        raise Finding(f"id {answer.get('id')!r} in the reply to {text[:200]!r}")


def test_one_input(data: bytes) -> None:
    _check(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None:
        _check(text)
    check = _strict_json(SERVER.handle(CHECK_CALL))
    if check.get("result", {}).get("content", [{}])[0].get("text") != "true":
        raise Finding(f"a valid call failed after {data[:200]!r}: {check}")


def _dictionary_entry(word: str) -> str:
    """A libFuzzer dictionary line: the word in double quotes, with \\ and \" escaped."""
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def main() -> None:
    argv = list(sys.argv)
    if not any(not argument.startswith("-") for argument in argv[1:]):
        DEFAULT_CORPUS.mkdir(parents=True, exist_ok=True)
        for index, seed in enumerate(SEEDS):
            (DEFAULT_CORPUS / f"seed-{index}").write_text(seed)
        argv.append(str(DEFAULT_CORPUS))
    if not any(argument.startswith("-dict=") for argument in argv):
        DICTIONARY.parent.mkdir(parents=True, exist_ok=True)
        DICTIONARY.write_text("".join(_dictionary_entry(word) + "\n" for word in WORDS))
        argv.append(f"-dict={DICTIONARY}")
    if not any(argument.startswith("-max_len=") for argument in argv):
        argv.append(f"-max_len={MAX_LEN}")
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
