"""Broker credentials and the generated ACL files (checked against the real Mosquitto tools)."""

import asyncio
from pathlib import Path

import pytest

from backend.transports.errors import CredentialError
from backend.transports.mqtt_credentials import (
    BridgeAccount,
    BrokerLimits,
    CredentialTable,
    DerivedCredentials,
    emqx_acl,
    emqx_auto_subscribe,
    emqx_conf,
    mosquitto_acl,
    mosquitto_conf,
    mosquitto_hash,
    mosquitto_hash_matches,
    write_mosquitto_password_file,
)
from testkit.mosquitto import Mosquitto, mosquitto_available, running_mosquitto
from tests.mqtt_wire import MqttRefused, RawMqttClient

needs_mosquitto = pytest.mark.skipif(not mosquitto_available(), reason="mosquitto not installed")


def test_derived_credentials() -> None:
    issuer = DerivedCredentials(b"bridge-secret-of-16+bytes")
    credential = issuer.issue("A4:CF:12:34:56:78")
    assert credential.username == "a4_cf_12_34_56_78"
    assert len(credential.password) == 32
    assert issuer.verify(credential.username, credential.password)
    assert not issuer.verify("a4_cf_12_34_56_79", credential.password)
    assert not issuer.verify(credential.username, credential.password[:-1] + "x")
    assert not issuer.verify("a/b", credential.password)
    assert DerivedCredentials(b"another-secret-16bytes").issue("a4:cf:12:34:56:78") != credential
    assert credential.password not in repr(credential)
    with pytest.raises(CredentialError):
        DerivedCredentials(b"short")


def test_credential_table() -> None:
    table = CredentialTable()
    first = table.issue("a4:cf:12:34:56:78")
    assert table.verify(first.username, first.password)
    second = table.issue("a4:cf:12:34:56:78")  # re-issuing replaces the password
    assert first.password != second.password
    assert not table.verify(first.username, first.password)
    assert table.verify(second.username, second.password)
    assert not table.verify("unknown", "x")
    table.revoke("a4:cf:12:34:56:78")
    assert not table.verify(second.username, second.password)


def test_mosquitto_hash_format() -> None:
    hashed = mosquitto_hash("secret", salt=bytes(12))
    assert hashed.startswith("$7$101$AAAAAAAAAAAAAAAA$")
    assert mosquitto_hash_matches(hashed, "secret")
    assert not mosquitto_hash_matches(hashed, "Secret")
    assert not mosquitto_hash_matches("garbage", "secret")


@needs_mosquitto
def test_our_hash_checker_reads_what_mosquitto_passwd_writes(tmp_path: Path) -> None:
    path = write_mosquitto_password_file(
        tmp_path / "pw", [("alice", "pa:ss word"), ("bob", "other")], use_tool=True
    )
    entries = dict(line.split(":", 1) for line in path.read_text().splitlines())
    assert set(entries) == {"alice", "bob"}
    assert mosquitto_hash_matches(entries["alice"], "pa:ss word")
    assert not mosquitto_hash_matches(entries["alice"], "other")
    assert path.stat().st_mode & 0o777 == 0o600


def test_logins_that_would_break_the_file_are_refused(tmp_path: Path) -> None:
    for login in [("ali:ce", "pw"), ("", "pw"), ("bob", "pw\nevil:x")]:
        with pytest.raises(CredentialError):
            write_mosquitto_password_file(tmp_path / "pw", [login])


@needs_mosquitto
@pytest.mark.parametrize("use_tool", [False, True])
async def test_mosquitto_accepts_the_generated_password_file(
    tmp_path: Path, use_tool: bool
) -> None:
    async with running_mosquitto(tmp_path, {"dev-1": "right password"}) as broker:
        # running_mosquitto writes with the tool; rewrite with our hashing and restart for False.
        if not use_tool:
            write_mosquitto_password_file(
                tmp_path / "passwords",
                [(broker.bridge.username, broker.bridge.password), ("dev-1", "right password")],
            )
            assert "$7$101$" in (tmp_path / "passwords").read_text()
            await broker.restart()
        good = RawMqttClient("127.0.0.1", broker.port)
        await good.connect("c1", "dev-1", "right password")
        await good.disconnect()
        bad = RawMqttClient("127.0.0.1", broker.port)
        with pytest.raises(MqttRefused) as refused:
            await bad.connect("c2", "dev-1", "wrong password")
        assert refused.value.code in (4, 5)
        await bad.abort()


DEVICE_A, DEVICE_B = "a4_cf_12_34_56_78", "a4_cf_12_34_56_79"


@needs_mosquitto
@pytest.mark.parametrize("clean_session", [True, False], ids=["clean", "persistent"])
async def test_on_mosquitto_a_device_cannot_knock_another_offline_with_its_client_id(
    tmp_path: Path, clean_session: bool
) -> None:
    # Without `use_username_as_clientid`, A's own valid login with B's client id made Mosquitto
    # disconnect B (a session take-over); now every device's client id is its username.
    logins = {DEVICE_A: "password-of-device-a", DEVICE_B: "password-of-device-b"}
    async with running_mosquitto(tmp_path, logins) as broker:
        bridge_side = RawMqttClient("127.0.0.1", broker.port)
        await bridge_side.connect("bridge-test", broker.bridge.username, broker.bridge.password)
        victim = RawMqttClient("127.0.0.1", broker.port)
        await victim.connect(DEVICE_B, DEVICE_B, logins[DEVICE_B])
        assert await victim.subscribe(f"xiaozhi/{DEVICE_B}/down") == [1]

        async def victim_still_receives(marker: bytes) -> None:
            await bridge_side.publish(f"xiaozhi/{DEVICE_B}/down", marker, qos=1)
            got = await victim.next_publish(5)
            assert (got.topic, got.payload) == (f"xiaozhi/{DEVICE_B}/down", marker)
            assert not victim.closed.is_set()

        await victim_still_receives(b"before")
        intruders = []
        for client_id in (DEVICE_B, f"GID_xiaozhi@@@{DEVICE_B}@@@0b1c2d3e-uuid"):
            intruder = RawMqttClient("127.0.0.1", broker.port)
            await intruder.connect(
                client_id, DEVICE_A, logins[DEVICE_A], clean_session=clean_session
            )
            intruders.append(intruder)
        await victim_still_receives(b"after")
        # What the intruder can still do is replace its own connection: the first one is gone.
        await asyncio.wait_for(intruders[0].closed.wait(), 5)
        assert not intruders[1].closed.is_set()
        for client in (*intruders, victim):
            await client.abort()
        await bridge_side.disconnect()


@needs_mosquitto
async def test_on_mosquitto_each_bridge_instance_needs_its_own_account(tmp_path: Path) -> None:
    # One account means one client id: a second client of the bridge's account replaces the
    # first. Two bridge instances therefore get two accounts, which the generated ACL allows.
    logins = {DEVICE_A: "password-of-device-a"}
    broker = Mosquitto(tmp_path, logins)
    second = BridgeAccount("bridge-2")
    accounts = [broker.bridge, second]
    write_mosquitto_password_file(
        tmp_path / "passwords",
        [*((a.username, a.password) for a in accounts), *logins.items()],
    )
    (tmp_path / "acl").write_text(
        mosquitto_acl("xiaozhi", broker.bridge.username, more_bridge_usernames=["bridge-2"])
    )
    await broker.start()
    try:
        bridges = []
        for account in accounts:
            client = RawMqttClient("127.0.0.1", broker.port)
            await client.connect("esp32-mcp-bridge", account.username, account.password)
            assert await client.subscribe("xiaozhi/+/up") == [1]
            bridges.append(client)
        dev = RawMqttClient("127.0.0.1", broker.port)
        await dev.connect(DEVICE_A, DEVICE_A, logins[DEVICE_A])
        await dev.publish(f"xiaozhi/{DEVICE_A}/up", b"{}", qos=1)
        for client in bridges:
            assert (await client.next_publish(5)).topic == f"xiaozhi/{DEVICE_A}/up"
            assert not client.closed.is_set()
        again = RawMqttClient("127.0.0.1", broker.port)
        await again.connect("another-id", second.username, second.password)
        await asyncio.wait_for(bridges[1].closed.wait(), 5)
        assert not bridges[0].closed.is_set()
        for client in (*bridges, again, dev):
            await client.abort()
    finally:
        await broker.stop()


def test_mosquitto_conf_ties_client_ids_to_usernames(tmp_path: Path) -> None:
    conf = mosquitto_conf(port=1883, password_file=tmp_path / "pw", acl_file=tmp_path / "acl")
    lines = conf.splitlines()
    assert "use_username_as_clientid true" in lines
    assert "allow_anonymous false" in lines and "set_tcp_nodelay true" in lines


def test_mosquitto_conf_bounds(tmp_path: Path) -> None:
    conf = mosquitto_conf(port=1883, password_file=tmp_path / "pw", acl_file=tmp_path / "acl")
    lines = conf.splitlines()
    for line in [
        "max_packet_size 66560",
        "message_size_limit 65536",
        "max_qos 1",
        "max_connections 1000",
        "max_queued_bytes 4194304",
        "persistent_client_expiration 1h",
        "retain_available true",
        "connection_messages false",
    ]:
        assert line in lines, line
    assert "log_type information" not in lines
    # Listener options come after their `listener` line, global ones before it.
    listener = lines.index("listener 1883 127.0.0.1")
    assert lines.index("max_qos 1") > listener > lines.index("max_packet_size 66560")
    custom = BrokerLimits(max_message_bytes=8192, retain_available=False, log_connections=True)
    lines = mosquitto_conf(
        port=1, password_file=tmp_path / "pw", acl_file=tmp_path / "acl", limits=custom
    ).splitlines()
    assert {"max_packet_size 9216", "retain_available false", "log_type information"} <= set(lines)
    with pytest.raises(CredentialError):
        BrokerLimits(max_keepalive_s=5)


def test_emqx_conf_bounds() -> None:
    conf = emqx_conf()
    for line in [
        "  use_username_as_clientid = true",
        '  max_packet_size = "65KB"',
        "  max_qos_allowed = 1",
        "  retain_available = true",
        '  session_expiry_interval = "1h"',
        "  max_mqueue_len = 1000",
        "  deny_action = disconnect",
        "flapping_detect {",
        "listeners.tcp.default {",
        '  max_conn_rate = "100/s"',
    ]:
        assert line in conf.splitlines(), line
    assert "retain_available = false" in emqx_conf(BrokerLimits(retain_available=False))


def test_mosquitto_acl_text() -> None:
    text = mosquitto_acl("site/xiaozhi", "bridge")
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines == [
        "user bridge",
        "topic readwrite site/xiaozhi/#",
        "pattern write site/xiaozhi/%u/up",
        "pattern write site/xiaozhi/%u/status",
        "pattern read site/xiaozhi/%u/down",
    ]
    more = mosquitto_acl("xiaozhi", "bridge", more_bridge_usernames=["bridge-2", "bridge"])
    assert [line for line in more.splitlines() if line.startswith(("user", "topic"))] == [
        "user bridge",
        "topic readwrite xiaozhi/#",
        "user bridge-2",
        "topic readwrite xiaozhi/#",
    ]
    with pytest.raises(CredentialError):
        mosquitto_acl("xiaozhi", "bridge", more_bridge_usernames=["bad\nname"])


def test_emqx_rules_and_auto_subscribe() -> None:
    acl = emqx_acl("xiaozhi", "bridge")
    assert '{allow, {username, "bridge"}, all, ["xiaozhi/#"]}.' in acl
    assert "will" in acl  # says why a foreign will falls through to the final deny
    assert '{allow, all, publish, ["xiaozhi/${username}/up", "xiaozhi/${username}/status"]}.' in acl
    assert '{allow, all, subscribe, ["xiaozhi/${username}/down"]}.' in acl
    assert acl.rstrip().endswith("{deny, all}.")
    two = emqx_acl("xiaozhi", "bridge", more_bridge_usernames=["bridge-2"])
    assert '{allow, {username, "bridge-2"}, all, ["xiaozhi/#"]}.' in two
    assert two.index('"bridge-2"') < two.index("{allow, all, publish")
    auto = emqx_auto_subscribe("xiaozhi")
    assert '{ topic = "xiaozhi/${username}/down", qos = 1 }' in auto
