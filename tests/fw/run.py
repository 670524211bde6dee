"""Run the firmware tests: `python run.py [test_module ...]` or `micropython run.py [...]`.

Works from any working directory; puts this folder and ../../firmware/lib on sys.path, prints
"N passed, M failed" and exits 1 on any failure. The wasm runner imports this module instead and
awaits main(), because the WebAssembly port has no asyncio.run.
"""

import sys


def _directory_of(path) -> str:
    cut = path.rfind("/")
    if cut < 0:
        return "."
    return path[:cut] or "/"


HERE = _directory_of(__file__)
FIRMWARE_LIB = HERE + "/../../firmware/lib"


async def main(modules=None) -> int:
    """Run the tests; returns the number of failed tests."""
    for path in (FIRMWARE_LIB, HERE):
        if path not in sys.path:
            sys.path.insert(0, path)
    import tinytest

    summary = await tinytest.main(HERE, modules)
    return summary.failed


if __name__ == "__main__":
    import asyncio

    failed = asyncio.run(main(sys.argv[1:] or None))
    sys.exit(1 if failed else 0)
