"""Scoped API keys on the bridge database."""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backend.keys import KEYS_MIGRATIONS, InvalidKey, KeyStore, Scope, UnknownKey
from backend.keys.store import KEY_REFRESH_S, admin_principal, hash_token
from backend.storage import Database
from testkit.postgres import postgres_available
from tests.helpers import eventually
from tests.storage_helpers import database_target

__all__ = ["database_target"]  # the fixture: every test here runs on SQLite and PostgreSQL


@pytest.fixture
async def store(database_target: Path | str) -> AsyncIterator[KeyStore]:
    db = Database(database_target, KEYS_MIGRATIONS)
    await db.open()
    yield KeyStore(db)
    await db.close()


async def test_create_authenticate_and_scopes(store: KeyStore) -> None:
    created = await store.create("kitchen speaker app", ["chat:use", Scope.DEVICES_READ])
    assert created.token.startswith("esk_") and len(created.token) > 50
    assert "esk_" not in repr(created)  # the token stays out of logs
    principal = await store.authenticate(created.token)
    assert principal.key_id == created.key.id and principal.name == "kitchen speaker app"
    assert principal.has("chat:use") and principal.has(Scope.DEVICES_READ)
    assert not principal.has(Scope.DEVICES_CALL) and not principal.has(Scope.ADMIN)
    assert not principal.may_call("dev1") and principal.may_read("dev1")
    assert principal.call_denied_reason("dev1") == "missing scope devices:call"
    assert (await store.authenticate(f"Bearer {created.token}")).key_id == created.key.id


async def test_device_limited_call_scope(store: KeyStore) -> None:
    created = await store.create("one device", ["devices:call"], device_ids=["dev1"])
    principal = await store.authenticate(created.token)
    assert principal.may_call("dev1") and not principal.may_call("dev2")
    assert principal.call_denied_reason("dev2") == "scope devices:call does not cover device dev2"
    everywhere = await store.authenticate((await store.create("all", ["devices:call"])).token)
    assert everywhere.may_call("dev2") and everywhere.device_ids is None


async def test_admin_has_every_scope(store: KeyStore) -> None:
    principal = await store.authenticate((await store.create("ops", ["admin"])).token)
    assert all(principal.has(scope) for scope in Scope) and principal.may_call("any")
    assert admin_principal().may_call("any")


async def test_only_hashes_are_stored(store: KeyStore) -> None:
    created = await store.create("k", ["chat:use"])
    rows = await store.db.fetchall("SELECT * FROM api_keys")
    dump = repr([tuple(row) for row in rows])
    secret = created.token.rsplit("_", 1)[1]
    assert secret not in dump and hash_token(created.token) in dump


@pytest.mark.parametrize(
    "token",
    ["", "esk_", "nonsense", "esk_000000000000_x", "Bearer esk_zz"],
)
async def test_bad_tokens_are_refused(store: KeyStore, token: str) -> None:
    await store.create("k", ["chat:use"])
    with pytest.raises(InvalidKey):
        await store.authenticate(token)


async def test_wrong_secret_for_a_real_key_id_is_refused(store: KeyStore) -> None:
    created = await store.create("k", ["chat:use"])
    forged = created.token[:-4] + ("AAAA" if not created.token.endswith("AAAA") else "BBBB")
    with pytest.raises(InvalidKey):
        await store.authenticate(forged)


async def test_revoke_and_list(store: KeyStore) -> None:
    first = await store.create("first", ["chat:use"])
    second = await store.create("second", ["devices:read"])
    await store.authenticate(first.token)
    revoked = await store.revoke(first.key.id)
    assert not revoked.active
    with pytest.raises(InvalidKey):
        await store.authenticate(first.token)
    listed = await store.list()
    assert [(k.name, k.active) for k in listed] == [("first", False), ("second", True)]
    assert listed[0].last_used_at is not None and listed[1].last_used_at is None
    assert [k.id for k in await store.list(include_revoked=False)] == [second.key.id]
    with pytest.raises(UnknownKey):
        await store.revoke("missing")


async def test_invalid_input(store: KeyStore) -> None:
    with pytest.raises(ValueError, match="unknown scope"):
        await store.create("k", ["chat:abuse"])
    with pytest.raises(ValueError, match="at least one scope"):
        await store.create("k", [])
    with pytest.raises(ValueError):
        await store.create("  ", ["chat:use"])


@pytest.mark.skipif(not postgres_available(), reason="PostgreSQL not installed")
async def test_a_key_revoked_on_one_instance_is_refused_on_another(postgres_url: str) -> None:
    first_db = Database(postgres_url, KEYS_MIGRATIONS)
    second_db = Database(postgres_url, KEYS_MIGRATIONS)
    await first_db.open()
    await second_db.open()
    first = KeyStore(first_db)
    strict = KeyStore(second_db, refresh_s=0)  # authenticate reads the database every time
    assert first.refresh_s == KEY_REFRESH_S  # shared database: the default refreshes
    try:
        await first.load()
        await strict.load()
        created = await first.create("shared", ["chat:use"])
        # Created on the first instance, known on the second at its next authenticate.
        assert (await strict.authenticate(created.token)).key_id == created.key.id
        await first.revoke(created.key.id)
        with pytest.raises(InvalidKey):
            await strict.authenticate(created.token)
        with pytest.raises(InvalidKey):
            await first.authenticate(created.token)
    finally:
        await first.aclose()
        await strict.aclose()
        await first_db.close()
        await second_db.close()


@pytest.mark.skipif(not postgres_available(), reason="PostgreSQL not installed")
async def test_the_in_memory_index_follows_other_instances_within_the_refresh(
    postgres_url: str,
) -> None:
    first_db = Database(postgres_url, KEYS_MIGRATIONS)
    second_db = Database(postgres_url, KEYS_MIGRATIONS)
    await first_db.open()
    await second_db.open()
    first = KeyStore(first_db)
    second = KeyStore(second_db, refresh_s=0.05)
    try:
        await first.load()
        await second.load()
        created = await first.create("shared", ["devices:read"])
        await eventually(lambda: second.resolve(created.token) is not None)
        await first.revoke(created.key.id)
        await eventually(lambda: second.resolve(created.token) is None)
        assert second.active(created.key.id) is None
    finally:
        await first.aclose()
        await second.aclose()
        await first_db.close()
        await second_db.close()


async def test_the_bridges_own_sqlite_file_is_not_refreshed(tmp_path: Path) -> None:
    db = Database(tmp_path / "bridge.sqlite3", KEYS_MIGRATIONS)
    assert KeyStore(db).refresh_s is None
