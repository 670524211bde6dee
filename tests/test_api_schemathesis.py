"""The admin API against its own OpenAPI description, with schemathesis: generated requests to
every documented operation of a real `esp32-bridge serve` (with one simulated device), checked
for no 500 and for errors in the `{"error": {"code", "message"}}` shape.

`SCHEMATHESIS_EXAMPLES` sets the examples per operation (a few in the default run).
"""

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from simulator.fleet import device_id_for
from tests.helpers import ADMIN_TOKEN, CLI, DEVICE_TOKEN

EXAMPLES = int(os.environ.get("SCHEMATHESIS_EXAMPLES", "12"))
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real bridge process with one simulated device; yields the admin API URL."""
    data_dir = tmp_path_factory.mktemp("schemathesis")
    env = {
        **os.environ,
        "BRIDGE_ADMIN_TOKEN": ADMIN_TOKEN,
        "BRIDGE_DEVICE_TOKEN": DEVICE_TOKEN,
        "BRIDGE_DEVICE_AUTH": "shared",
        "BRIDGE_LLM_PROVIDER": "none",  # chat routes answer offline: no model, no internet
        "BRIDGE_SEARCH_ENABLED": "false",
    }
    serve = [*CLI, "serve", "--data-dir", str(data_dir), "--ws-port", "0", "--http-port", "0"]
    serve += ["--device-http-port", "0"]
    log_file = (data_dir / "bridge.log").open("w")  # read it when a case fails: the traceback
    bridge = subprocess.Popen(serve, env=env, stderr=log_file)
    fleet = None
    try:
        runtime = _wait_for(data_dir / "bridge.json")
        fleet = subprocess.Popen(
            [*CLI, "simulate", "--url", runtime["ws_url"], "--devices", "1"],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        _wait_ready(runtime["api_url"], device_id_for(1))
        yield runtime["api_url"]
    finally:
        for process in (fleet, bridge):
            if process is not None:
                process.terminate()
                process.wait(10)
        log_file.close()


def _wait_for(path: Path) -> Any:
    deadline = time.monotonic() + 30
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)
    return json.loads(path.read_text())


def _wait_ready(api_url: str, device_id: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        response = httpx.get(f"{api_url}/api/devices/{device_id}", headers=AUTH)
        if response.status_code == 200 and response.json()["state"] == "ready":
            return
        time.sleep(0.05)
    raise TimeoutError(f"{device_id} never became ready")


@pytest.fixture(scope="module")
def api_schema(served: str) -> Any:
    return schemathesis.openapi.from_url(f"{served}/openapi.json")


def error_shape(ctx: Any, response: Any, case: Any) -> None:
    """Every error is `{"error": {"code": str, "message": str}}`."""
    if response.status_code < 400:
        return
    where = (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:200]!r}"
    )
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(f"not JSON: {where}") from None
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict), where
    assert isinstance(error.get("code"), str) and isinstance(error.get("message"), str), where


def test_no_500_and_every_error_in_one_shape(api_schema: Any, served: str) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 8
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case: Any) -> None:
            case.call_and_validate(
                base_url=served, headers=AUTH, checks=[not_a_server_error, error_shape]
            )

        check()


def test_the_schema_covers_the_admin_routes(api_schema: Any) -> None:
    paths = set(api_schema.raw_schema["paths"])
    assert {"/api/devices", "/api/devices/{device_id}/tools/call", "/healthz"} <= paths
