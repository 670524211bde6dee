"""The settings and tokens every test and benchmark bridge uses: loopback ports, known tokens,
short timeouts, no LLM, web search or voice unless asked; with `TEST_DATABASE=postgresql` every
bridge on a fresh database of a throwaway PostgreSQL."""

import atexit
import os
from pathlib import Path
from typing import Any

from backend.config import Settings

ADMIN_TOKEN = "admin-secret-token-for-tests"
DEVICE_TOKEN = "device-secret-token-for-tests"


def make_settings(data_dir: Path, **overrides: Any) -> Settings:
    """Bridge settings on ephemeral loopback ports with the tests' tokens and short timeouts;
    chat runs offline without web search unless a test points it at the fake LLM. Devices use
    the shared test token (the development mode `device_auth = "shared"`): the suite tests the
    core with it; the provisioning tests set `device_auth="device"`, the default."""
    values: dict[str, Any] = {
        "admin_token": ADMIN_TOKEN,
        "device_token": DEVICE_TOKEN,
        "hello_timeout_s": 5.0,
        "init_timeout_s": 5.0,
        "call_timeout_s": 5.0,
        "llm_provider": "none",
        "search_enabled": False,
        "voice_enabled": False,  # text-only test devices; the voice tests turn it on
    }
    if "database_url" not in overrides and (url := suite_database()) is not None:
        values["database_url"] = url
    return Settings.on_loopback(data_dir, **{**values, **overrides})


_SUITE_POSTGRES: Any = None


def suite_database() -> str | None:
    """With `TEST_DATABASE=postgresql`, a fresh database on this process's throwaway PostgreSQL
    for every bridge the tests make, so the whole suite (not only the store tests, which run on
    both engines anyway) runs on PostgreSQL: `TEST_DATABASE=postgresql scripts/test`."""
    global _SUITE_POSTGRES
    if os.environ.get("TEST_DATABASE", "sqlite") != "postgresql":
        return None
    if _SUITE_POSTGRES is None:
        from testkit.postgres import PostgresServer

        server = PostgresServer()
        server.start()
        atexit.register(server.destroy)
        _SUITE_POSTGRES = server
    url: str = _SUITE_POSTGRES.new_database()
    return url
