"""The pieces of provisioning on their own: version compare, the tolerant system-info summary,
token buckets (on an injected clock), confirmation rules, chat confirmation answers, tokens."""

import pytest

from backend.chat.confirm import ConfirmationBook, PendingConfirmation, answer_kind
from backend.devices.confirm import ConfirmationPolicy
from backend.mcp_session import Tool
from backend.provisioning.ota import (
    OtaHeaders,
    is_newer,
    no_upgrade,
    parse_version,
    summarize,
    upgrade,
)
from backend.provisioning.ratelimit import KeyedLimiter, Limits, device_key, host_of, partition_of
from backend.provisioning.tokens import bare_token, derive_token, token_hash
from tests.helpers import ManualClock


@pytest.mark.parametrize(
    ("candidate", "current", "newer"),
    [
        ("2.4.3", "2.4.2", True),
        ("2.4.10", "2.4.9", True),  # numbers, not text
        ("2.5", "2.4.9", True),
        ("1.0.1", "1.0", True),
        ("1.0.0", "1", False),
        ("2.4.2", "2.4.2", False),
        ("2.4.1", "2.4.2", False),
        ("3.0.0", "2.4.2-beta", False),  # unparseable: never an offer on a guess
        ("3.0.0", None, False),
    ],
)
def test_versions_compare_as_dot_separated_integers(
    candidate: str, current: str | None, newer: bool
) -> None:
    assert is_newer(candidate, current) is newer


def test_a_no_upgrade_answer_never_carries_a_version_stock_firmware_cannot_parse() -> None:
    assert no_upgrade("2.4.2") == {"version": "2.4.2", "url": ""}
    assert no_upgrade("2.4.2-sim") is None and no_upgrade("v1") is None and no_upgrade(None) is None
    assert parse_version("1." + "9" * 10) is None
    with pytest.raises(AssertionError):
        upgrade("v2", "http://x", "ab", 1)


def test_the_summary_is_tolerant_and_keeps_unknown_fields() -> None:
    headers = OtaHeaders(
        device_id="a4:cf:12:34:56:78",
        client_id="c",
        user_agent="bread-compact-wifi/2.4.2",
        accept_language="vi-VN",
    )
    body = {
        "minimum_free_heap_size": "158595",
        "flash_size": "not a number",
        "chip_model_name": ["wrong type"],
        "board": {"type": "x" * 500, "carrier": "CMCC", "csq": 20, "rssi": True},
        "new_thing": {"a": 1},
    }
    summary = summarize(body, headers)
    assert summary["minimum_free_heap_size"] == 158595
    assert "flash_size" not in summary and "chip" not in summary
    assert len(summary["board_type"]) == 128
    assert summary["firmware_version"] == "2.4.2"  # from the User-Agent
    assert summary["language"] == "vi-VN"
    assert summary["network"] == {"type": "cellular", "carrier": "CMCC", "csq": 20}
    assert summary["system_info"]["new_thing"] == {"a": 1}
    only_ua = summarize({}, headers)
    assert only_ua["board_type"] == "bread-compact-wifi"


def test_a_token_bucket_refuses_past_its_burst_and_recovers() -> None:
    clock = ManualClock()
    limiter = KeyedLimiter(2.0, 3, clock=clock)
    assert [limiter.allow("ip") for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("other")  # its own bucket
    clock.now += 0.5  # one token back at 2/s
    assert [limiter.allow("ip") for _ in range(2)] == [True, False]
    clock.now += 100
    assert [limiter.allow("ip") for _ in range(4)] == [True, True, True, False]  # capped at 3
    assert limiter.refused == 3


def test_a_penalized_key_waits_a_whole_burst_each_time() -> None:
    clock = ManualClock()
    limiter = KeyedLimiter(1.0, 10, clock=clock)
    limiter.penalize("device")  # a fresh key starts empty, a burst in debt
    clock.now += 10.5
    assert not limiter.allow("device")  # -10 + 10.5 = 0.5: not a whole token yet
    clock.now += 0.5
    assert limiter.allow("device") and not limiter.allow("device")
    limiter.penalize("device")  # cut off again at once: another 11 s, never a fresh burst
    clock.now += 10.9
    assert not limiter.allow("device")
    clock.now += 0.2
    assert limiter.allow("device")
    assert limiter.allow("untouched")


def test_the_bucket_table_is_bounded() -> None:
    limiter = KeyedLimiter(1.0, 1, max_keys=100, clock=ManualClock())
    for index in range(10_000):
        limiter.allow(f"device-{index}")
    assert len(limiter) == 100
    for index in range(1_000):
        limiter.penalize(f"cut-{index}")
    assert len(limiter) == 100


def test_exempt_networks_are_not_limited_per_ip() -> None:
    from backend.config import DEFAULT_RATE_LIMITS, RateLimit

    tight = {name: RateLimit(per_s=0.001, burst=1) for name in DEFAULT_RATE_LIMITS}
    limits = Limits(tight, ["127.0.0.0/8", "::1/128"], clock=ManualClock())
    assert all(limits.ip_refusal("ota", "127.0.0.1") is None for _ in range(5))
    assert all(limits.ip_refusal("ota", "::1") is None for _ in range(5))
    assert limits.ip_refusal("ota", "192.168.1.9") is None
    assert limits.ip_refusal("ota", "192.168.1.9") is not None
    assert limits.device_refusal("ota", "d") is None and limits.device_refusal("ota", "d")
    assert host_of("192.168.1.9:5555") == "192.168.1.9" and host_of("::1:5555") == "::1"


def tool(name: str, **annotations: object) -> Tool:
    return Tool(name=name, inputSchema={"type": "object"}, annotations=annotations or None)


def test_confirmation_rules_last_match_wins_per_tool_and_device() -> None:
    policy = ConfirmationPolicy(
        ["*.reboot", "*upgrade*", "!a4:cf:*/self.reboot", "02:00:00:00:00:01/self.led.set"]
    )
    assert policy.reason("02:00:00:00:00:09", tool("self.reboot")) == "rule '*.reboot'"
    assert policy.reason("a4:cf:00:00:00:01", tool("self.reboot")) is None
    assert policy.reason("x", tool("self.ota.upgrade_now")) == "rule '*upgrade*'"
    assert policy.reason("02:00:00:00:00:01", tool("self.led.set")) is not None
    assert policy.reason("02:00:00:00:00:02", tool("self.led.set")) is None
    assert policy.reason("x", tool("self.wipe", destructiveHint=True)) is not None
    assert policy.reason("x", tool("self.wipe", destructiveHint=False)) is None
    lenient = ConfirmationPolicy([], destructive_hint=False)
    assert lenient.reason("x", tool("self.wipe", destructiveHint=True)) is None
    with pytest.raises(ValueError):
        ConfirmationPolicy(["dev/"])


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("Yes, go ahead", "yes"),
        ("ok", "yes"),
        ("Có, làm đi", "yes"),
        ("đồng ý", "yes"),
        ("No thanks", "no"),
        ("không", "no"),
        ("Hủy", "no"),
        ("Yes please!", "yes"),
        ("vâng ạ", "yes"),
        ("No, cancel that", "no"),
        ("không cần đâu", "other"),
        ("yes no", "other"),
        ("Why would you reboot?", "other"),
        ("", "other"),
        # Questions and new requests that only start like an answer.
        ("Có nên dùng nước súc miệng không?", "other"),
        ("Đồng hồ mấy giờ rồi", "other"),
        ("ok but first tell me about floss", "other"),
        ("no, set the volume to 20 instead", "other"),
        ("Không biết răng khôn có cần nhổ không?", "other"),
    ],
)
def test_answers_to_a_confirmation_question(text: str, kind: str) -> None:
    assert answer_kind(text) == kind


def test_a_question_is_answered_once_and_expires() -> None:
    clock = ManualClock()
    book = ConfirmationBook(ttl_s=300, limit=2, clock=clock)
    asked = PendingConfirmation("d", "self.reboot", "self_reboot", {}, "rule", clock.now)
    book.remember(["conversation:a", "device:d"], asked)
    assert book.take(["device:d"]) is asked
    assert book.take(["conversation:a"]) is None  # gone under every key
    book.remember(["conversation:a"], asked)
    clock.now += 301
    assert book.take(["conversation:a"]) is None
    for name in "abc":
        book.remember([f"conversation:{name}"], asked)
    assert len(book) == 2  # bounded


def test_tokens_are_per_device_and_per_generation() -> None:
    secret = b"s" * 32
    first = derive_token(secret, "a4:cf:12:34:56:78", 1)
    assert first.startswith("dtk_") and " " not in first and len(first) > 40
    assert derive_token(secret, "a4:cf:12:34:56:78", 1) == first
    assert derive_token(secret, "a4:cf:12:34:56:79", 1) != first
    assert derive_token(secret, "a4:cf:12:34:56:78", 2) != first
    assert derive_token(b"t" * 32, "a4:cf:12:34:56:78", 1) != first
    assert token_hash(first) != first and len(token_hash(first)) == 64
    assert bare_token(f"Bearer {first}") == first == bare_token(first)


@pytest.mark.parametrize(
    ("ip", "partition"),
    [
        ("203.0.113.7", ("203.0.113.7", "203.0.113.0/24")),
        ("2001:db8:1:2:aaaa::1", ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64")),
        ("[2001:db8:1:2::9]", ("2001:db8:1:2::9", "2001:db8:1:2::/64")),
        ("fe80::1%eth0", ("fe80::1", "fe80::/64")),
        ("::ffff:198.51.100.20", ("198.51.100.20", "198.51.100.0/24")),  # mapped: IPv4
        (None, ("unknown", "unknown")),
        ("not an address", ("unknown", "unknown")),
    ],
)
def test_pending_activations_are_shared_out_by_address_and_prefix(
    ip: str | None, partition: tuple[str, str]
) -> None:
    assert partition_of(ip) == partition


def test_a_device_budget_is_the_devices_own_only_once_its_client_id_is_checked() -> None:
    assert device_key("a4:cf:00:00:00:01", "c1", checked=True) == "a4:cf:00:00:00:01"
    unchecked = {device_key("a4:cf:00:00:00:01", c, checked=False) for c in ("c1", "c2")}
    assert len(unchecked) == 2 and "a4:cf:00:00:00:01" not in unchecked
