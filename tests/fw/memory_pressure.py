"""Real MemoryErrors under a small MicroPython heap (`micropython -X heapsize=128K`): in a tool
and in the JSON parser they must come back as JSON-RPC errors, and the server must keep working.
Prints one reply per line. Not a test_* module: tests/test_firmware_runtimes.py runs it on the
unix port only, because the WebAssembly port's heap cannot be capped.
"""

import gc
import sys

sys.path.insert(0, "../../firmware/lib")

from mcp_server import McpServer, integer  # noqa: E402


def _hog(args):
    return len(bytearray(args["kb"] * 1024))


def _call(request_id, kb):
    return (
        '{"jsonrpc":"2.0","id":%d,"method":"tools/call",'
        '"params":{"name":"self.hog","arguments":{"kb":%d}}}' % (request_id, kb)
    )


def main():
    server = McpServer("small-heap", "1")
    server.add_tool("self.hog", "allocates kb KiB", [integer("kb")], _hog)
    print(server.handle(_call(1, 4)))
    print(server.handle(_call(2, 4096)))
    gc.collect()
    # Its text fits the heap, the parsed list of one pointer per element does not.
    elements = gc.mem_free() // 8
    print(server.handle("[" + "1," * elements + "1]"))
    print(server.handle(_call(3, 4)))


main()
