"""How scripts/test spreads the suite over its pytest-xdist workers (`--dist loadscope`; xdist is
pinned below 4 in pyproject.toml because `_split_scope` is not its public API).

A test module is one unit of work, so a module-scoped fixture (the recognition runs of
test_voice_recognition, the schemathesis document) is built once, not once per worker. The
modules listed in SPREAD hold long, independent tests (benchmark runs, `serve` processes): each of
their tests is a unit of its own, and they are handed out first, so the longest do not start
last and hold the phase's tail alone. Everything else keeps collection order."""

from typing import Any

from xdist.scheduler import LoadScopeScheduling

SPREAD = (  # the longest first: the heads of the queue
    "tests/test_bench_smoke.py",
    "tests/test_lifecycle.py",
    "tests/test_cli_voice.py",
    "tests/test_cli.py",
    "tests/test_mqtt_bridge.py",
    "tests/test_firmware_e2e.py",
    "tests/test_fuzz_parsers.py",
    "tests/test_catalog.py",
)


def spread_rank(nodeid: str) -> int:
    """Where a test's module stands in SPREAD; len(SPREAD) for a module kept whole."""
    module = nodeid.split("::", 1)[0]
    return SPREAD.index(module) if module in SPREAD else len(SPREAD)


class SpreadScheduling(LoadScopeScheduling):
    """Load by module, except the SPREAD modules: each of their tests is its own unit. Units go
    out in collection order (see `spread_first`), not by their number of tests, which would
    hand out the single-test units last."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        if spread_rank(nodeid) < len(SPREAD):
            return nodeid
        return nodeid.split("::", 1)[0]


def spread_first(items: list[Any]) -> None:
    """Reorder the collection in place: the SPREAD modules' tests first, in SPREAD's order
    (every worker sorts alike, so their collections stay identical)."""
    items.sort(key=lambda item: spread_rank(item.nodeid))
