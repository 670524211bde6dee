"""Event loop lag."""

import asyncio

from prometheus_client import Gauge, Histogram

from backend.metrics.core import REGISTRY, SWITCH

LAG_INTERVAL_S = 0.5
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

_loop_lag = Histogram(
    "bridge_event_loop_lag_seconds",
    f"How late a {LAG_INTERVAL_S:g} s sleep on the event loop wakes up (time others held it).",
    buckets=LAG_BUCKETS,
    registry=REGISTRY,
)
_loop_lag_last = Gauge(
    "bridge_event_loop_lag_last_seconds",
    "The lag of the latest such sleep.",
    registry=REGISTRY,
)


async def measure_loop_lag(interval_s: float = LAG_INTERVAL_S) -> None:
    """Run until cancelled: sleep `interval_s` again and again and record the overshoot, which
    is how long something else kept the loop (a slow callback, a blocking call)."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag = max(0.0, loop.time() - due)
        if SWITCH.on:
            _loop_lag.observe(lag)
            _loop_lag_last.set(lag)
