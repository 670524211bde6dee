"""backend.common: the helpers every package shares (times, clipped text, loopback addresses)."""

import pytest

from backend.common import (
    WILDCARD_HOSTS,
    Backoff,
    KeyedBuckets,
    Lru,
    TokenBucket,
    clip,
    excerpt,
    iso_time,
    reachable_host,
    url_host,
)
from tests.helpers import ManualClock


def test_iso_time_is_utc_and_keeps_none() -> None:
    assert iso_time(0) == "1970-01-01T00:00:00+00:00"
    assert iso_time(1_700_000_000.5) == "2023-11-14T22:13:20.500000+00:00"
    assert iso_time(None) is None


def test_excerpt_keeps_short_text_exactly() -> None:
    assert excerpt("a\nb  c") == "a\nb  c"  # whitespace is evidence in a log line: kept


def test_excerpt_cuts_and_tells_the_length() -> None:
    assert excerpt("x" * 500, 10) == "xxxxxxxxxx… (500 chars)"


def test_excerpt_shows_a_non_string_as_its_repr() -> None:
    assert excerpt(b"\x00\xff") == "b'\\x00\\xff'"
    assert excerpt(None) == "None"


def test_clip_folds_whitespace_to_one_line() -> None:
    assert clip("  one\n\ttwo   three ", 100) == "one two three"


def test_clip_cuts_at_a_word_in_the_second_half() -> None:
    assert clip("alpha beta gamma delta", 15) == "alpha beta…"


def test_clip_cuts_inside_a_word_when_no_space_is_in_the_second_half() -> None:
    assert clip("abcdefghijklmnop qr", 10) == "abcdefghi…"


def test_clip_drops_punctuation_before_the_ellipsis() -> None:
    assert clip("first, second, third, fourth", 20) == "first, second…"


def test_clip_without_at_word_uses_the_whole_budget() -> None:
    clipped = clip("alpha beta gamma delta", 15, at_word=False)
    assert clipped == "alpha beta gam…" and len(clipped) == 15


@pytest.mark.parametrize("value, expected", [(None, ""), (42, "42"), ({"a": 1}, "{'a': 1}")])
def test_clip_reads_none_as_empty_and_other_values_as_text(value: object, expected: str) -> None:
    assert clip(value, 50) == expected


@pytest.mark.parametrize(
    "host, expected",
    [
        ("0.0.0.0", "127.0.0.1"),
        ("", "127.0.0.1"),
        ("::", "::1"),  # an IPv6 wildcard may be IPv6-only: its loopback is ::1
        ("192.0.2.7", "192.0.2.7"),
        ("::1", "::1"),
        ("bridge.example", "bridge.example"),
    ],
)
def test_reachable_host_maps_wildcards_to_the_loopback_of_their_family(
    host: str, expected: str
) -> None:
    assert reachable_host(host) == expected
    assert reachable_host(host) not in WILDCARD_HOSTS


@pytest.mark.parametrize(
    "host, expected",
    [("::1", "[::1]"), ("[::1]", "[::1]"), ("127.0.0.1", "127.0.0.1"), ("a.b", "a.b")],
)
def test_url_host_brackets_ipv6_once(host: str, expected: str) -> None:
    assert url_host(host) == expected


def test_a_bounded_table_keeps_the_most_recently_put_and_drops_the_oldest() -> None:
    table: Lru[str, int] = Lru(3)
    for number, key in enumerate("abcd"):
        table.put(key, number)
    assert list(table) == ["b", "c", "d"]  # "a", the oldest, went
    table.put("b", 10)  # put again: the newest now
    table.put("e", 4)
    assert list(table.items()) == [("d", 3), ("b", 10), ("e", 4)]
    assert len(table) == table.limit == 3


def test_backoff_doubles_to_its_cap_with_jitter_and_starts_again_after_a_reset() -> None:
    backoff = Backoff(0.1, 0.8, jitter=(0.5, 1.0))
    waits = [backoff.next_wait() for _ in range(6)]
    bases = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]
    assert all(base * 0.5 <= wait <= base for wait, base in zip(waits, bases, strict=True))
    assert backoff.attempts == 6
    backoff.reset()
    assert 0.05 <= backoff.next_wait() <= 0.1


def test_a_token_bucket_spends_a_burst_then_refills_at_its_rate() -> None:
    bucket = TokenBucket(2.0, 3, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.missed == 1
    assert bucket.take(0.5) and not bucket.take(0.5)  # one token in half a second at 2/s
    assert bucket.refill(100.0) == 3.0  # never more than the burst
    assert bucket.refill(50.0) == 3.0  # a clock going back adds nothing


def test_keyed_buckets_are_per_key_and_bounded() -> None:
    clock = ManualClock()
    buckets = KeyedBuckets(1.0, 1, limit=2, clock=clock)
    assert buckets.take("a") and not buckets.take("a")
    assert buckets.take("b")  # another key, its own burst
    assert buckets.peek("c") is None and len(buckets) == 2  # peeking makes no bucket
    assert buckets.take("c")  # "a", the least recently used, goes
    assert len(buckets) == 2 and buckets.evicted == 1 and buckets.peek("a") is None
    assert buckets.take("a")  # an evicted key comes back full: the bound is on memory
    clock.advance(1.0)
    assert buckets.take("c")
