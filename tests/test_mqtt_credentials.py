"""Broker credentials and the generated ACL files (checked against the real Mosquitto tools)."""

from pathlib import Path

import pytest

from backend.transports.mqtt_credentials import (
    CredentialError,
    CredentialTable,
    DerivedCredentials,
    emqx_acl,
    emqx_auto_subscribe,
    mosquitto_acl,
    mosquitto_hash,
    mosquitto_hash_matches,
    write_mosquitto_password_file,
)
from tests.mosquitto import mosquitto_available, running_mosquitto
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


def test_emqx_rules_and_auto_subscribe() -> None:
    acl = emqx_acl("xiaozhi", "bridge")
    assert '{allow, {username, "bridge"}, all, ["xiaozhi/#"]}.' in acl
    assert '{allow, all, publish, ["xiaozhi/${username}/up", "xiaozhi/${username}/status"]}.' in acl
    assert '{allow, all, subscribe, ["xiaozhi/${username}/down"]}.' in acl
    assert acl.rstrip().endswith("{deny, all}.")
    auto = emqx_auto_subscribe("xiaozhi")
    assert '{ topic = "xiaozhi/${username}/down", qos = 1 }' in auto
