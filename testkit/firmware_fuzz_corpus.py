"""Feed a fuzz corpus to the firmware's McpServer.handle, run by the MicroPython unix port (not by
CPython):

    MICROPYPATH=firmware/lib micropython testkit/firmware_fuzz_corpus.py CORPUS

(`-`: read CORPUS from stdin; without MICROPYPATH, firmware/lib of a source checkout is used).
`testkit.firmware_fuzzing.run_micropython_corpus` generates the corpus with hypothesis on
CPython and streams it here (tests/test_firmware_fuzz.py, bench/fuzz.py). CORPUS has one input
per line, `t <hex>` (UTF-8 text; fed as bytes if this runtime will not decode it) or `b <hex>`
(bytes). For each input: handle() must not raise, a reply must be a JSON-RPC object that carries
the request's id when that is usable, and a valid call right after must still work. Prints the
first problems and the line "fuzz: N inputs, E escapes, B bad replies, K broken"; exits 1 on any
problem.

The firmware modules exist only on MicroPython's path, hence the mypy code disabled below;
everything else is type-checked.
"""

# mypy: disable-error-code="import-not-found"

import json
import sys

try:
    from collections.abc import Iterator
    from typing import IO
except ImportError:  # MicroPython: annotations are not evaluated there
    pass


def _directory_of(path: str) -> str:
    cut = path.rfind("/")
    if cut < 0:
        return "."
    return path[:cut] or "/"


del sys.path[0]  # this folder (simulator/): nothing in it may shadow a firmware module
sys.path.append(_directory_of(__file__) + "/../firmware/lib")  # after MICROPYPATH, if set

import hal_fake  # noqa: E402
import tools_stock  # noqa: E402
from mcp_server import McpServer  # noqa: E402

CODES = (-32700, -32600, -32601, -32602, -32603)
CHECK_CALL = (
    '{"jsonrpc":"2.0","id":"check","method":"tools/call",'
    '"params":{"name":"self.audio_speaker.set_volume","arguments":{"volume":42}}}'
)
SHOWN = 10  # problems printed in full
BLOCK = 65536
MAX_INPUT = 65536  # bytes: the firmware's WebSocket transport refuses a longer message
MAX_LINE = 2 + 2 * MAX_INPUT  # "t " and the input in hex


def decode(line: str) -> str | bytes:
    kind, data = line[0], bytes.fromhex(line[2:].strip())
    if kind == "t":
        try:
            return str(data, "utf-8")
        except UnicodeError:  # lone surrogates: a WebSocket text frame could not carry them
            return data
    return data


def usable_id(request: object) -> tuple[bool, object]:
    """(True, id) when the request is an object with an id a reply can carry."""
    if not isinstance(request, dict) or "id" not in request:
        return False, None
    value = request["id"]
    if isinstance(value, bool):
        return False, None
    if isinstance(value, float):
        return value - value == 0, value  # not NaN or infinite
    return isinstance(value, (str, int)), value


def reply_problem(reply: str | None, data: str | bytes) -> str | None:
    """Why `reply` is not a proper answer to `data`, or None."""
    if reply is None:
        return None
    try:
        answer = json.loads(reply)
    except ValueError:
        return "reply is not JSON"
    if not isinstance(answer, dict) or answer.get("jsonrpc") != "2.0":
        return "not a JSON-RPC reply"
    if ("result" in answer) == ("error" in answer):
        return "needs exactly one of result and error"
    error = answer.get("error")
    if error is not None:
        if not isinstance(error, dict) or error.get("code") not in CODES:
            return "bad error code"
        if not isinstance(error.get("message"), str):
            return "error without a message"
    try:
        request = json.loads(data)
    except Exception:  # not JSON for this runtime: the reply has no id to carry
        request = None
    usable, request_id = usable_id(request)
    if usable and answer.get("id") != request_id:
        return "id " + repr(answer.get("id")) + " instead of " + repr(request_id)
    if not usable and answer.get("id") is not None:
        return "id " + repr(answer.get("id")) + " for a request without a usable id"
    return None


def still_works(server: McpServer) -> bool:
    try:
        answer = json.loads(server.handle(CHECK_CALL))
        return bool(answer["id"] == "check" and answer["result"]["content"][0]["text"] == "true")
    except Exception:
        return False


def lines(corpus: "IO[str]", skipped: "list[int]") -> "Iterator[str]":
    """The non-empty lines of `corpus`, read in blocks (readline reads byte by byte here). A
    line over MAX_LINE is skipped unread, counted in `skipped[0]`: it holds an input longer
    than the firmware's transports hand to the server, and holding it whole would take more
    heap than the test is about."""
    pending = ""
    skipping = False
    while True:
        block = corpus.read(BLOCK)
        if not block:
            break
        start = 0
        end = block.find("\n")
        while end >= 0:
            size = len(pending) + end - start
            if not skipping and size > MAX_LINE:
                skipped[0] += 1
            elif not skipping and size:
                yield pending + block[start:end]
            skipping = False
            pending = ""
            start = end + 1
            end = block.find("\n", start)
        if not skipping:
            pending += block[start:]
            if len(pending) > MAX_LINE:
                pending = ""
                skipping = True
                skipped[0] += 1
    if pending.strip() and not skipping:
        yield pending


def feed(corpus: "IO[str]") -> int:
    """Feed every input of `corpus` to a fresh server; the number of problems."""
    server = McpServer("fuzz-board", "1.0")
    tools_stock.register(server, hal_fake.HalFake())
    inputs = escapes = bad = broken = 0
    skipped = [0]
    for line in lines(corpus, skipped):
        data = decode(line)
        inputs += 1
        problem = None
        try:
            reply = server.handle(data)
        except Exception as error:  # what the fuzzing looks for: count and show it
            escapes += 1
            problem = "escaped: " + type(error).__name__ + ": " + str(error)
        else:
            problem = reply_problem(reply, data)
            if problem is not None:
                bad += 1
        if not still_works(server):
            broken += 1
            problem = (problem or "") + " then a valid call failed"
        if problem is not None and escapes + bad + broken <= SHOWN:
            print("input " + str(inputs) + ": " + problem + ": " + repr(data[:120]))
    if skipped[0]:
        print(f"fuzz: {skipped[0]} inputs over {MAX_INPUT} bytes skipped")
    print(f"fuzz: {inputs} inputs, {escapes} escapes, {bad} bad replies, {broken} broken")
    return escapes + bad + broken


def main(path: str) -> int:
    """Feed the corpus at `path` (`-`: stdin); the number of problems."""
    if path == "-":
        return feed(sys.stdin)
    with open(path) as corpus:
        return feed(corpus)


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1]) else 0)
