"""The HTTP API against its own OpenAPI description, with schemathesis: the `schemathesis run`
CLI over the whole document of a real `esp32-bridge serve` (with one simulated device), every
phase (examples, coverage, fuzzing, stateful) and every check schemathesis has, plus the API's
own error shape (tests/schemathesis_hooks.py): no 500, every status and content type and header
documented, responses matching their schemas, bad input refused, unsupported methods 405 with
`Allow`, auth not ignored, a deleted resource gone.

Each check left out for an operation is listed in SCHEMATHESIS_CONFIG with the reason.
`SCHEMATHESIS_EXAMPLES` sets the examples per operation (a few in the default run).
"""

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis

from simulator.fleet import device_id_for
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from tests.helpers import CLI

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
        "BRIDGE_VOICE_ENABLED": "false",
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


# Checks left out, each for the operations it cannot apply to, and why. Everything else runs
# everywhere. `positive_data_acceptance` expects every request the schema allows to succeed
# (or be 404/409); these operations refuse some schema-valid requests for reasons a JSON Schema
# cannot say, and answer 422 (400 under /v1) with a message saying which.
SCHEMATHESIS_CONFIG = """
# Every check schemathesis 4 has (`--checks all` on the command line would override the
# per-operation lines below). max_response_time is left at its default (off): no timing
# thresholds in tests.
[checks]
not_a_server_error.enabled = true
status_code_conformance.enabled = true
content_type_conformance.enabled = true
response_schema_conformance.enabled = true
response_headers_conformance.enabled = true
positive_data_acceptance.enabled = true
negative_data_rejection.enabled = true
use_after_free.enabled = true
ensure_resource_availability.enabled = true
missing_required_header.enabled = true
ignored_auth.enabled = true
object_level_authorization.enabled = true
unsupported_method.enabled = true
allow_header_conformance.enabled = true
openai_error_shape.enabled = true

# Ids that exist, so generated requests reach past the lookup (the coverage phase still sends
# ids that do not).
[parameters]
"path.device_id" = "{device_id}"
"path.model" = "dental-duckduckgo"

# The file must exist in the bridge's firmware folder: state, not shape.
[[operations]]
include-path = "/api/firmware"
include-method = "POST"
checks.positive_data_acceptance.enabled = false

# A version already published is refused (unpublish first), and the image must be readable.
[[operations]]
include-path = "/api/firmware/{{board}}/{{version}}"
include-method = "PUT"
checks.positive_data_acceptance.enabled = false

# The question is the *last* user message, which must hold text (not only spaces) and
# at most 4,000 characters (context_length_exceeded): a rule over the order of array items.
[[operations]]
include-path = "/v1/chat/completions"
checks.positive_data_acceptance.enabled = false

# The same rule for /v1/responses (the question is the last user message of `input`), and
# fields the schema allows that ask for what the bridge refuses (client tools, JSON formats).
[[operations]]
include-path = "/v1/responses"
include-method = "POST"
checks.positive_data_acceptance.enabled = false

# A serial number is 1 to 64 *printable* characters after stripping (str.isprintable: no
# control, format, private-use or unassigned character), a Unicode-category rule that the
# document's regex dialect cannot say portably; the length is in the schema.
[[operations]]
include-path = "/api/provisioning/serial-keys/{{serial}}"
include-method = "PUT"
checks.positive_data_acceptance.enabled = false

# A scope is a known name or mcp:<server>; the list of scopes is being widened by the
# external MCP servers work (backend/keys/store.py) and the schema says it in words only.
[[operations]]
include-path = "/api/keys"
include-method = "POST"
checks.positive_data_acceptance.enabled = false
"""


@pytest.mark.timeout(360)  # ~100 s alone on a loaded 2-core machine
def test_schemathesis_finds_nothing_over_the_whole_document(served: str, tmp_path: Path) -> None:
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG.format(device_id=device_id_for(1)))
    run = [
        str(Path(sys.executable).with_name("schemathesis")),
        "--config-file",
        str(config),
        "--no-color",
        "run",
        f"{served}/openapi.json",
        "--phases",
        "examples,coverage,fuzzing,stateful",
        "--max-examples",
        str(EXAMPLES),
        "--generation-deterministic",
        "--workers",
        "1",
        "--header",
        f"Authorization: Bearer {ADMIN_TOKEN}",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks"}
    result = subprocess.run(
        run, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report[-20000:]
    tested = re.search(r"Tested:\s+(\d+)", report)  # every operation reached, none skipped
    selected = re.search(r"Selected:\s+(\d+)/(\d+)", report)
    assert tested and selected, report[-3000:]
    assert int(tested[1]) == int(selected[1]) == int(selected[2]) >= 30, report[-3000:]


def test_the_schema_covers_the_admin_routes(api_schema: Any) -> None:
    paths = set(api_schema.raw_schema["paths"])
    assert {"/api/devices", "/api/devices/{device_id}/tools/call", "/healthz"} <= paths
