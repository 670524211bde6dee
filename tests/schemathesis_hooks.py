"""Schemathesis hooks for tests/test_api_schemathesis.py (loaded by the CLI through
`SCHEMATHESIS_HOOKS=tests.schemathesis_hooks`): the API's own error shape as one more check."""

from typing import Any

import schemathesis

FIELDS = {"message", "type", "param", "code"}
TYPES = {
    "invalid_request_error",
    "permission_error",
    "not_found_error",
    "rate_limit_error",
    "server_error",
}


@schemathesis.check
def openai_error_shape(ctx: Any, response: Any, case: Any) -> None:
    """Every error is `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape), and
    under /v1 a refused request is never 422 (the openai SDKs expect 400)."""
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
    assert isinstance(body, dict) and set(body) == {"error"}, where
    assert isinstance(error, dict) and set(error) == FIELDS, where
    assert isinstance(error["message"], str) and isinstance(error["code"], str), where
    assert error["type"] in TYPES, where
    assert error["param"] is None or isinstance(error["param"], str), where
    if case.path.startswith("/v1/"):
        assert response.status_code != 422, where


# `GET /api/fleet/events` streams until the client leaves; a checker reads a response whole.
# So every request it sends that the API would answer with the endless stream asks for the
# snapshot only (`snapshot_only=true`); a value the API refuses is left for the checks.
_EVENTS_PATH = "/api/fleet/events"
_FALSE = {"0", "off", "f", "false", "n", "no"}


@schemathesis.hook
def before_call(ctx: Any, case: Any, kwargs: dict[str, Any]) -> None:
    if case.path != _EVENTS_PATH or case.method.upper() != "GET":
        return
    query = case.query if isinstance(case.query, dict) else {}
    value = query.get("snapshot_only")
    last = value[-1] if isinstance(value, list) and value else value
    if last is None or str(last).lower() in _FALSE:  # str(False) == "False", str(0) == "0"
        case.query = {**query, "snapshot_only": "true"}
