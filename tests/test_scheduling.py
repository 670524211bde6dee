"""The parallel phase's scheduling (tests/scheduling.py): modules whole, SPREAD tests alone."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.scheduling import SPREAD, SpreadScheduling, spread_first


def _scheduler() -> SpreadScheduling:
    option = SimpleNamespace(loadscopereorder=True, maxworkerrestart=None, numprocesses=2)
    values = {"tx": ["2*popen"], "dist": "loadscope"}
    config = SimpleNamespace(option=option, getvalue=values.get)
    return SpreadScheduling(config)


def test_a_module_is_one_unit_and_a_spread_test_is_its_own() -> None:
    scheduler = _scheduler()
    assert scheduler._split_scope("tests/test_api.py::test_a[x]") == "tests/test_api.py"
    bench = f"{SPREAD[0]}::test_quick_run_writes_its_section[voice]"
    assert scheduler._split_scope(bench) == bench
    # Units go out in collection order, not by their number of tests.
    assert scheduler.config.option.loadscopereorder is False


def test_spread_tests_come_first_in_spread_order_and_the_rest_keep_theirs() -> None:
    items = [
        SimpleNamespace(nodeid=nodeid)
        for nodeid in [
            "tests/test_a.py::one",
            f"{SPREAD[1]}::slow",
            "tests/test_b.py::two",
            f"{SPREAD[0]}::slower",
            "tests/test_a.py::three",
        ]
    ]
    spread_first(items)  # type: ignore[arg-type]
    assert [item.nodeid for item in items] == [
        f"{SPREAD[0]}::slower",
        f"{SPREAD[1]}::slow",
        "tests/test_a.py::one",
        "tests/test_b.py::two",
        "tests/test_a.py::three",
    ]


@pytest.mark.parametrize("module", SPREAD)
def test_every_spread_module_exists(module: str) -> None:
    assert (Path(__file__).resolve().parent.parent / module).is_file()
