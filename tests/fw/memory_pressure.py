"""Real MemoryErrors under a small MicroPython heap (`micropython -X heapsize=128K`): in a tool
and in the JSON parser they must come back as JSON-RPC errors, and the server must keep working.
Prints one reply per line. Not a test_* module: tests/test_firmware_runtimes.py runs it on the
unix port only, because the WebAssembly port's heap cannot be capped.

The parser's MemoryError must not depend on how fragmented the heap happens to be (which varies
with the paths and environment of the run), so the request is small text with a large parsed
form: a list of empty lists, 3 bytes of text but about 70 parsed bytes each on a 64-bit port.
Its size comes from probes of this heap: the parsed bytes per element, and the free heap, so
that the parsed form needs twice the free heap while the text needs a few percent of it.
"""

import gc
import json
import sys

sys.path.insert(0, "../../firmware/lib")

from mcp_server import McpServer, integer  # noqa: E402

ELEMENT = "[]"
PROBE_ELEMENTS = 64
OVERSIZE = 2  # the parsed form needs this many times the free heap


def _hog(args):
    return len(bytearray(args["kb"] * 1024))


def _call(request_id, kb):
    return (
        '{"jsonrpc":"2.0","id":%d,"method":"tools/call",'
        '"params":{"name":"self.hog","arguments":{"kb":%d}}}' % (request_id, kb)
    )


def _list_text(elements):
    return "[" + (ELEMENT + ",") * (elements - 1) + ELEMENT + "]"


def _parsed_bytes_per_element():
    """Heap that one parsed element keeps alive, measured on a small list."""
    text = _list_text(PROBE_ELEMENTS)
    gc.collect()
    before = gc.mem_alloc()
    parsed = json.loads(text)
    gc.collect()
    used = gc.mem_alloc() - before
    del parsed
    return used // PROBE_ELEMENTS


def _oversized_request():
    """(text, elements, bytes per element): text whose parsed form cannot fit in the heap.

    Building the text needs one block of 3 bytes per element; if even that fails, the text is
    made smaller, as long as its parsed form still exceeds the free heap."""
    per_element = _parsed_bytes_per_element()
    gc.collect()
    elements = OVERSIZE * gc.mem_free() // per_element + 1
    while True:
        try:
            text = _list_text(elements)
            break
        except MemoryError:
            gc.collect()
            elements = elements * 3 // 4
            if elements * per_element <= gc.mem_free():
                raise SystemExit("the heap is too fragmented for a %d-byte text" % (3 * elements))
    gc.collect()  # the intermediate strings of the concatenation
    return text, elements, per_element


def main():
    server = McpServer("small-heap", "1")
    server.add_tool("self.hog", "allocates kb KiB", [integer("kb")], _hog)
    print(server.handle(_call(1, 4)))
    print(server.handle(_call(2, 4096)))
    text, elements, per_element = _oversized_request()
    free = gc.mem_free()
    if elements * per_element <= free:  # the parser must be unable to succeed
        raise SystemExit("%d elements of %d bytes fit in %d free" % (elements, per_element, free))
    print(server.handle(text))
    del text
    print(server.handle(_call(3, 4)))
    sys.stderr.write(
        "parsed %d elements of %d bytes = %d bytes against %d free; text %d bytes\n"
        % (elements, per_element, elements * per_element, free, 3 * elements + 1)
    )


main()
