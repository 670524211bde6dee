"""The MQTT topic scheme: building, parsing, and what a device can never smuggle into a topic."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backend.transports.errors import TopicError
from backend.transports.mqtt_topics import (
    DeviceTopic,
    Presence,
    TopicKind,
    TopicScheme,
    build_client_id,
    device_id_from_key,
    device_key,
    parse_client_id,
    parse_presence,
    validate_device_key,
)

SCHEME = TopicScheme()


def test_topics_of_a_device() -> None:
    key = device_key("A4:CF:12:34:56:78")
    assert key == "a4_cf_12_34_56_78"
    assert SCHEME.up(key) == "xiaozhi/a4_cf_12_34_56_78/up"
    assert SCHEME.down(key) == "xiaozhi/a4_cf_12_34_56_78/down"
    assert SCHEME.status(key) == "xiaozhi/a4_cf_12_34_56_78/status"
    assert SCHEME.filter(TopicKind.UP) == "xiaozhi/+/up"
    assert SCHEME.all_topics == "xiaozhi/#"


def test_parse_round_trips_and_names_the_device() -> None:
    for kind in TopicKind:
        parsed = SCHEME.parse(SCHEME.topic("a4_cf_12_34_56_78", kind))
        assert parsed == DeviceTopic("a4_cf_12_34_56_78", kind)
        assert parsed.device_id == "a4:cf:12:34:56:78"


def test_multi_level_prefix() -> None:
    scheme = TopicScheme("site-1/xiaozhi")
    assert scheme.parse("site-1/xiaozhi/dev-7/up") == DeviceTopic("dev-7", TopicKind.UP)
    with pytest.raises(TopicError):
        scheme.parse("xiaozhi/dev-7/up")
    with pytest.raises(TopicError):
        scheme.parse("site-1/other/dev-7/up")


@pytest.mark.parametrize(
    "topic",
    [
        "xiaozhi/+/up",
        "xiaozhi/#",
        "xiaozhi/a4_cf_12_34_56_78/up/extra",
        "xiaozhi/a4_cf_12_34_56_78",
        "xiaozhi//up",
        "xiaozhi/a4_cf_12_34_56_78/sideways",
        "other/a4_cf_12_34_56_78/up",
        "$SYS/a4_cf_12_34_56_78/up",
        "xiaozhi/a4:cf:12:34:56:78/up",
        "xiaozhi/dev\x00ice/up",
        "xiaozhi/dévice/up",
        "/xiaozhi/a4_cf_12_34_56_78/up",
    ],
)
def test_parse_refuses_anything_but_a_concrete_device_topic(topic: str) -> None:
    with pytest.raises(TopicError):
        SCHEME.parse(topic)


@pytest.mark.parametrize("bad", ["", "+", "#", "a/b", "$SYS", "a+b", "x" * 65, "dé", "a b"])
def test_device_keys_are_one_safe_level(bad: str) -> None:
    with pytest.raises(TopicError):
        validate_device_key(bad)
    with pytest.raises(TopicError):
        SCHEME.up(bad)


@pytest.mark.parametrize("bad", ["", "a//b", "a/+", "#", "$SYS", "a/", "/a"])
def test_prefix_validation(bad: str) -> None:
    with pytest.raises(TopicError):
        TopicScheme(bad)


def test_device_ids_and_keys() -> None:
    assert device_key("a4:cf:12:34:56:78") == "a4_cf_12_34_56_78"
    assert device_id_from_key("A4_CF_12_34_56_78") == "a4:cf:12:34:56:78"
    assert device_key("sim-001") == "sim-001"
    assert device_id_from_key("sim_001") == "sim_001"
    with pytest.raises(TopicError):
        device_key("sim:1")  # a colon that is not a MAC has no unambiguous key
    with pytest.raises(TopicError):
        device_key("a/b")


@given(st.text(max_size=80))
def test_no_text_parses_into_a_topic_with_wildcards_or_other_levels(text: str) -> None:
    topic = f"xiaozhi/{text}/up"
    try:
        parsed = SCHEME.parse(topic)
    except TopicError:
        return
    assert parsed.device_key == text
    assert not set(text) & set("+#/$\x00")
    assert SCHEME.is_own(text, topic, TopicKind.UP)
    assert not SCHEME.is_own(text, topic, TopicKind.DOWN)


def test_is_own_only_for_the_same_device() -> None:
    up_a = SCHEME.up("dev-a")
    assert SCHEME.is_own("dev-a", up_a, TopicKind.UP, TopicKind.STATUS)
    assert not SCHEME.is_own("dev-b", up_a, TopicKind.UP, TopicKind.STATUS)
    assert not SCHEME.is_own("dev-a", "xiaozhi/+/up", TopicKind.UP)


def test_stock_client_id() -> None:
    parsed = parse_client_id("GID_test@@@a4_cf_12_34_56_78@@@0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0")
    assert parsed.group == "GID_test"
    assert parsed.device_key == "a4_cf_12_34_56_78"
    assert parsed.device_id == "a4:cf:12:34:56:78"
    assert parsed.client_id == "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
    built = build_client_id("A4:CF:12:34:56:78", parsed.client_id, "GID_test")
    assert built == str(parsed)


@pytest.mark.parametrize(
    "bad",
    [
        "plain-client",
        "GID@@@a4_cf_12_34_56_78",
        "GID@@@a4_cf_12_34_56_78@@@uuid@@@more",
        "GID@@@+@@@uuid",
        "GID@@@a/b@@@uuid",
        "GID@@@a4_cf_12_34_56_78@@@uu id",
        "@@@a4_cf_12_34_56_78@@@uuid",
    ],
)
def test_malformed_client_ids(bad: str) -> None:
    with pytest.raises(TopicError):
        parse_client_id(bad)


def test_presence_payloads() -> None:
    assert parse_presence(b"online") == Presence(True)
    assert parse_presence(b"offline\n") == Presence(False)
    event = Presence(True, "0b1c2d3e").encode()
    assert parse_presence(event) == Presence(True, "0b1c2d3e")
    assert parse_presence(b'{"state":"online","client_id":"bad id"}') == Presence(True)
    for bad in (b"", b"maybe", b"{}", b'{"state":"away"}', b"\xff\xfe"):
        with pytest.raises(TopicError):
            parse_presence(bad)


def test_a_message_claiming_another_device_is_told_apart_from_its_own_spellings() -> None:
    from backend.transports.mqtt_topics import claims_another_device

    me = "a4:cf:12:34:56:78"
    for own in ('{"device_id":"a4:cf:12:34:56:78"}', '{"device_id":"A4:CF:12:34:56:78"}',
                '{"device_id":"a4_cf_12_34_56_78"}', '{"type":"hello"}', "not json"):  # fmt: skip
        assert not claims_another_device(own, me), own
    for other in ('{"device_id":"a4:cf:12:34:56:79"}', '{"device_id":42}', '{"device_id":""}'):
        assert claims_another_device(other, me), other
