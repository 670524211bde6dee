"""Hostile devices against a live bridge (`esp32-bridge serve` in its own process, simulated
devices called through the admin API while the attack runs, each attack in its own process).

Every attack of issue #7 has its bound asserted: the bridge's RSS growth, the log lines it
wrote, whether the attacker was cut off, and that the other devices kept being served. The
latency bounds here are loose ceilings against starvation; the figures, with the no-attacker
baseline of the same run, are in docs/reliability.md (`python -m bench.reliability`).
"""

import json

import pytest

from backend.config import DEFAULT_RATE_LIMITS
from testkit.siege import Attack, Siege, SiegeResult, escaped_errors

# RSS growth and starvation latency bounds: alone on the CPU (scripts/test)
pytestmark = [pytest.mark.slow, pytest.mark.serial]

WINDOW_S = 1.5
MAX_RSS_GROWTH_MB = 20.0
MAX_LOG_LINES = 100  # per attack window (the target is per attacker per minute)
STARVED_MS = 1000.0  # a call or /healthz this slow means the attacker starved the others
POLICY_VIOLATION = 1008  # the bridge's close for breaking a bound (never 1011, a crash)


def assert_others_served(result: SiegeResult) -> None:
    assert result.call_errors == 0
    assert len(result.call_ms) >= 5, "the other devices were hardly called"
    assert max(result.call_ms) < STARVED_MS, result.call_ms
    assert max(result.healthz_ms) < STARVED_MS, result.healthz_ms


def assert_bounded(result: SiegeResult) -> None:
    assert result.rss_growth_mb < MAX_RSS_GROWTH_MB, result.rss_growth_mb
    assert result.log_lines < MAX_LOG_LINES, result.events
    assert result.errors == [], result.errors  # no exception reached the log, in any field
    assert_others_served(result)


async def test_memory_attacks_are_bounded_and_cut_off() -> None:
    async with Siege(devices=3) as siege:
        for index, name in enumerate(("ping_flood", "small_ping_flood", "list_changed_storm")):
            attack = Attack(name, WINDOW_S, f"a4:cf:66:66:00:{index:02x}")
            result = await siege.measure(attack, WINDOW_S)
            # The bridge's view: an attacker that reads nothing may never see our close frame.
            assert result.events.get("device cut off") == 1, (name, result.events)
            assert result.events.get("device disconnected", 0) >= 1, (name, result.events)
            assert_bounded(result)
        storm = result.attack
        assert storm.detail["tools_list_requests"] < 10, storm.detail  # coalesced

        flood = await siege.measure(Attack("tool_flood", WINDOW_S, "a4:cf:66:66:01:00"), WINDOW_S)
        assert flood.events.get("tool list truncated") == 1, flood.events
        assert_bounded(flood)


async def test_log_and_parser_bombs_cost_a_few_lines() -> None:
    async with Siege(devices=3) as siege:
        for index, name in enumerate(("log_bomb", "nesting_bomb", "binary_flood")):
            attack = Attack(name, WINDOW_S, f"a4:cf:66:66:02:{index:02x}")
            result = await siege.measure(attack, WINDOW_S)
            # Every bomb is parsed, dropped and logged within budget, and the flood of them is
            # cut off by the inbound limit: 1008. A parser that blew up would close 1011.
            assert result.attack is not None, name
            assert result.attack.close_code == POLICY_VIOLATION, (name, result.attack)
            assert result.events.get("device cut off") == 1, (name, result.events)
            assert_bounded(result)
        oversize = await siege.measure(Attack("oversize_frame", 1, "a4:cf:66:66:03:00"), 1)
        assert oversize.attack is not None and oversize.attack.close_code == 1009
        assert_bounded(oversize)


async def test_undecodable_binary_floods_are_cut_off_like_audio() -> None:
    """Frames that break the version 2 or 3 framing cost the device like audio frames do:
    the flood is cut off with 1008, and its drops cost a few lines."""
    async with Siege(devices=3) as siege:
        for index, name in enumerate(("binary_flood_v2", "binary_flood_v3")):
            attack = Attack(name, WINDOW_S, f"a4:cf:66:66:04:{index:02x}")
            result = await siege.measure(attack, WINDOW_S)
            assert result.attack is not None, name
            assert result.attack.close_code == POLICY_VIOLATION, (name, result.attack)
            assert result.events.get("device cut off") == 1, (name, result.events)
            assert result.events.get("dropped audio frame", 0) <= 3 + 1, result.events
            assert_bounded(result)


def test_an_escaped_traceback_is_found_in_any_field() -> None:
    """The check of `assert_bounded` can fail: a traceback in a JSON line's `exception` field
    (where structlog renders it), in any other field, or printed as plain text."""
    clean = json.dumps({"event": "device cut off", "reason": "inbound rate limit exceeded"})
    in_exception = json.dumps(
        {"event": "MCP background task failed", "exception": "Traceback (most recent..."}
    )
    exception_only = json.dumps({"event": "handler failed", "exception": "ValueError: x"})
    in_other_field = json.dumps({"event": "odd", "detail": "Traceback (most recent call last)"})
    plain = "Traceback (most recent call last):"
    lines = [clean, in_exception, exception_only, in_other_field, plain]
    assert escaped_errors(lines) == lines[1:]
    assert escaped_errors([clean]) == []


async def test_idle_sockets_hold_neither_descriptors_nor_memory() -> None:
    async with Siege(devices=3) as siege:
        result = await siege.measure(Attack("idle_sockets", 2000), 3.0)
    assert result.attack is not None
    # Past the per-address limit, the bridge drops them at accept instead of holding them.
    assert result.attack.detail["closed_by_bridge"] > 1000, result.attack.detail
    assert_bounded(result)


async def test_a_storm_of_one_device_id_is_throttled() -> None:
    async with Siege(devices=3) as siege:
        result = await siege.measure(Attack("same_id_storm", 500), WINDOW_S)
    assert result.attack is not None
    links = result.events.get("device disconnected", 0)  # one line per link the bridge took
    assert 1 <= links <= 10 + 1  # the burst of `handshake_device`
    assert_bounded(result)


async def test_devices_dropping_tcp_after_hello_leave_nothing_behind() -> None:
    async with Siege(devices=3) as siege:
        result = await siege.measure(Attack("drop_after_hello", 300), WINDOW_S)
        assert not any("never retrieved" in event for event in result.events), result.events
        # Shared-token mode lets one host claim many ids; the per-address limit bounds them:
        # its burst, plus what it refills while the attack lasts (at most the window).
        per_address = DEFAULT_RATE_LIMITS["connection_ip"]
        bound = per_address.burst + per_address.per_s * WINDOW_S
        assert 1 <= result.events.get("device disconnected", 0) <= bound < 300
        assert result.rss_growth_mb < MAX_RSS_GROWTH_MB
        assert_others_served(result)
