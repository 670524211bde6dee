"""Heap probe around the unchanged firmware, run by the MicroPython unix port (not by CPython).

    MICROPYPATH=DEPLOY:DEPLOY/lib:.frozen \
        micropython -X heapsize=175K firmware_memory_harness.py CONFIG [collect]

DEPLOY is laid out like the device: main.py plus lib/ (.mpy or .py). The harness imports the
firmware, notes the heap its modules hold, then runs main.start() with two probes: after the MCP
server builds a reply and when the transport has the bytes of an outgoing frame ready (the
moments when request, reply and frame bytes are all alive). Each MCP `ping` prints one line
`[mem] {json}` with the figures since the previous ping and resets them, so the driver
(testkit/firmware_memory.py) marks phases by pinging. With `collect` every probe runs gc.collect()
first, so its peak is the live heap rather than live data plus not yet collected garbage; that
changes when the collector runs, so survival is judged on runs without it.

The firmware modules and gc.mem_alloc/mem_free exist only under MicroPython, hence the mypy
codes disabled below; everything else is type-checked.
"""

# mypy: disable-error-code="import-not-found,attr-defined"

import gc
import json
import sys

del sys.path[0]  # this folder (simulator/): nothing in it may shadow a firmware module
gc.collect()
_INTERPRETER = gc.mem_alloc()

import hal_fake  # noqa: E402  (main imports it on demand; counted with the rest)
import main  # noqa: E402  (the firmware entry point; start() is called below)
import mcp_server  # noqa: E402
import transport_ws  # noqa: E402

gc.collect()
_IMPORTED = gc.mem_alloc()
_HEAP = _IMPORTED + gc.mem_free()
_COLLECT = len(sys.argv) > 2 and sys.argv[2] == "collect"


class Probe:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.samples = 0
        self.peak_alloc = 0
        self.min_free = _HEAP

    def sample(self) -> None:
        if _COLLECT:
            gc.collect()
        alloc = gc.mem_alloc()
        free = gc.mem_free()
        self.samples += 1
        if alloc > self.peak_alloc:
            self.peak_alloc = alloc
        if free < self.min_free:
            self.min_free = free

    def report(self) -> None:
        gc.collect()
        figures = {
            "heap": _HEAP,
            "interpreter": _INTERPRETER,
            "imported": _IMPORTED,
            "collect": _COLLECT,
            "samples": self.samples,
            "peak_alloc": self.peak_alloc,
            "min_free": self.min_free,
            "live_alloc": gc.mem_alloc(),
            "modules": [module.__file__ for module in (main, mcp_server, transport_ws, hal_fake)],
        }
        print("[mem] " + json.dumps(figures, separators=(",", ":")))
        self.reset()


PROBE = Probe()
_handle_message = mcp_server.McpServer.handle_message
_frame_chunks = transport_ws.frame_chunks


def _probed_handle_message(server: object, msg: object) -> object:
    reply = _handle_message(server, msg)
    PROBE.sample()
    if isinstance(msg, dict) and msg.get("method") == "ping":
        PROBE.report()
    return reply


def _probed_frame_chunks(opcode: int, payload: bytes, mask_key: object = None) -> object:
    chunks = _frame_chunks(opcode, payload, mask_key)
    PROBE.sample()
    return chunks


mcp_server.McpServer.handle_message = _probed_handle_message
transport_ws.frame_chunks = _probed_frame_chunks
main.start()
