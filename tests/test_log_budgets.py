"""Log budgets: a noisy device costs a few lines, and reconnecting buys it no fresh burst."""

import logging
from typing import Any

from backend.logs import DeviceBudgets, LibraryNoiseFilter, LineRate, LogBudget
from tests.helpers import ManualClock


class Lines:
    """A logger that records (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append(("warning", event, fields))


def test_a_burst_then_one_counted_summary_per_interval() -> None:
    lines, clock = Lines(), ManualClock(0.0)
    budget = LogBudget(lines, burst=3, interval_s=10, clock=clock)
    for _ in range(1000):
        budget.warning("dropped device message")
        clock.now += 0.01  # 1,000 frames in 10 s
    clock.now += 0.1
    budget.warning("dropped device message")
    assert [event for _level, event, _ in lines.lines] == ["dropped device message"] * 3 + [
        "dropped device message (repeated)"
    ]
    assert lines.lines[-1][2] == {"repeated": 998, "total": 1001}
    budget.close()  # nothing pending: nothing written
    assert len(lines.lines) == 4
    budget.warning("dropped device message")
    budget.close()  # a pending count is written when the source goes away
    assert lines.lines[-1][1:] == (
        "dropped device message (repeated)",
        {"repeated": 1, "total": 1002},
    )


def test_a_device_keeps_its_budget_across_links() -> None:
    first, second = Lines(), Lines()
    budgets = DeviceBudgets(burst=2)
    for _ in range(5):
        budgets.get("a4:cf:00:00:00:01", first).warning("listen")
        budgets.get("a4:cf:00:00:00:01", first).warning("abort")
    budgets.flush("a4:cf:00:00:00:01")  # its link ended: the pending counts, in one line
    assert [e for _l, e, _f in first.lines] == ["listen", "abort"] * 2 + [
        "device log lines suppressed"
    ]
    assert first.lines[-1][2] == {"repeated": {"listen": 3, "abort": 3}}
    budgets.flush("a4:cf:00:00:00:01")  # nothing pending: nothing written
    assert len(first.lines) == 5
    for _ in range(5):  # it reconnects and carries on: counted, not written again in full
        budgets.get("a4:cf:00:00:00:01", second).warning("listen")
    assert second.lines == []
    budgets.get("a4:cf:00:00:00:02", second).warning("listen")  # another device: its own
    assert [e for _l, e, _f in second.lines] == ["listen"]


def test_the_device_table_is_bounded() -> None:
    budgets = DeviceBudgets(max_devices=50)
    for index in range(5000):
        budgets.get(f"device-{index}", Lines())
    assert len(budgets) == 50


def _record(name: str, message: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, (), None)


def test_library_noise_is_a_burst_per_kind_and_distinct_messages_share_one_budget() -> None:
    noise = LibraryNoiseFilter(burst=3, interval_s=3600)
    kept = [
        noise.filter(_record("asyncio", "Task exception was never retrieved")) for _ in range(50)
    ]
    assert kept.count(True) == 3
    # Messages that all differ (a repr inside) cannot grow the table or the log without end.
    distinct = [
        noise.filter(_record("websockets.server", f"connection {i} failed")) for i in range(5000)
    ]
    assert len(noise._seen) == LibraryNoiseFilter.MAX_KINDS + 1  # and one "other" kind
    assert distinct.count(True) == LibraryNoiseFilter.MAX_KINDS - 1 + 3
    assert noise.filter(_record("myapp", "not a library")) is True  # ours are never filtered


def test_line_rate_lets_a_burst_then_a_few_a_minute_through_and_counts_the_rest() -> None:
    clock = ManualClock()
    rate = LineRate(burst=3, per_minute=6.0, clock=clock)
    assert [rate.allow("dev") for _ in range(5)] == [0, 0, 0, None, None]
    assert rate.allow("other") == 0  # per key
    clock.advance(10.0)  # one line's worth at 6 a minute
    assert rate.allow("dev") == 2  # written, carrying the two left out
    assert rate.allow("dev") is None
    bounded = LineRate(max_keys=2, clock=clock)
    for key in ("a", "b", "c"):
        bounded.allow(key)
    assert len(bounded) == 2
