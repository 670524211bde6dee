"""Hostile MQTT devices against a live bridge (`serve --mqtt embedded` in its own process,
simulated MQTT devices as the victims, each attack in its own process; issue #16).

The two attacks that did the most harm before the endpoint was the bridge's own: a last will
that spoke for another device, and one 64 MB PUBLISH. The victim checks are shown to be able to
fail by a control that really does speak as the victim (with its own login).
"""

import pytest

from testkit.hostile_mqtt import MqttSiege, MqttSiegeResult, mqtt_attack

# RSS growth and starvation latency bounds: alone on the CPU (scripts/test)
pytestmark = [pytest.mark.slow, pytest.mark.serial]

WINDOW_S = 2.0
MAX_RSS_GROWTH_MB = 20.0
MAX_LOG_LINES = 100
STARVED_MS = 1000.0
BODY = 64 * 1024 * 1024


def assert_victims_unaffected(result: MqttSiegeResult) -> None:
    assert result.acted_as_victim == 0, result.victim_lines
    assert result.victim_disconnects == 0, result.victim_lines
    assert result.call_errors == 0
    assert len(result.call_ms) >= 5, "the victims were hardly called"
    assert max(result.call_ms) < STARVED_MS, result.call_ms
    assert max(result.healthz_ms) < STARVED_MS, result.healthz_ms


def assert_bounded(result: MqttSiegeResult) -> None:
    assert result.rss_growth_mb < MAX_RSS_GROWTH_MB, result.rss_growth_mb
    assert result.log_lines < MAX_LOG_LINES, result.events
    assert result.errors == [], result.errors


async def test_a_will_cannot_speak_for_another_device_and_a_64_mb_publish_is_cut() -> None:
    async with MqttSiege(devices=2) as siege:
        will = await siege.measure(mqtt_attack("mqtt_will_impersonation", WINDOW_S), WINDOW_S)
        report = will.attack
        assert report is not None
        connacks = report.detail.get("connacks", {})
        assert report.sent > 0 and connacks.get("5", 0) >= 1, report.detail  # not authorized
        assert "0" not in connacks and not report.detail.get("accepted"), report.detail
        assert_victims_unaffected(will)
        assert_bounded(will)

        big = await siege.measure(mqtt_attack("mqtt_big_publish", WINDOW_S), WINDOW_S)
        report = big.attack
        assert report is not None and report.detail.get("connacks") == {"0": 1}, report
        # Cut from the header: what got through is what the socket buffers took, not 64 MB.
        assert report.close_code == 1008 and report.sent < BODY // 4, report
        assert big.events.get("mqtt device cut off") == 1, big.events
        assert_victims_unaffected(big)
        assert_bounded(big)

        # The control: the victim's own login saying the same words is seen as the victim
        # speaking (a turn in its name) and its link replaced (it went offline).
        control = await siege.measure(mqtt_attack("mqtt_control_victim_login", 2.0), 2.0)
        assert control.acted_as_victim >= 1, control.events
        assert control.victim_disconnects >= 1, control.events
