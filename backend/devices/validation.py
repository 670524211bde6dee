"""Tool arguments checked against the tool's inputSchema before anything is sent."""

import json
from functools import lru_cache
from typing import Any

import structlog
from jsonschema import Draft202012Validator, SchemaError
from jsonschema.exceptions import best_match

log = structlog.get_logger("devices.validation")


def argument_error(schema: dict[str, Any], arguments: dict[str, Any]) -> str | None:
    """Return a one-line reason when `arguments` break `schema`, else None."""
    validator = _validator_for(schema)
    if validator is None:
        return None
    error = best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    where = ".".join(str(part) for part in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


# Schema dict identity -> (the dict, its validator). Tools are frozen and shared between devices
# (mcp_session.models), so every call of a tool brings the same dict: this skips serialising the
# schema on each call. Holding the dict keeps its id from being reused while the entry lives.
_BY_IDENTITY: dict[int, tuple[dict[str, Any], Draft202012Validator | None]] = {}
_BY_IDENTITY_MAX = 1024


def _validator_for(schema: dict[str, Any]) -> Draft202012Validator | None:
    entry = _BY_IDENTITY.get(id(schema))
    if entry is not None and entry[0] is schema:
        return entry[1]
    validator = _validator(json.dumps(schema, sort_keys=True))
    if len(_BY_IDENTITY) >= _BY_IDENTITY_MAX:
        _BY_IDENTITY.clear()
    _BY_IDENTITY[id(schema)] = (schema, validator)
    return validator


@lru_cache(maxsize=512)
def _validator(schema_json: str) -> Draft202012Validator | None:
    # Devices of one model share schemas, so one compiled validator serves all of them.
    schema = json.loads(schema_json)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        # A device's broken schema must not block its tool: the device validates too.
        log.warning("tool schema is not valid JSON Schema; skipping validation", error=exc.message)
        return None
    return Draft202012Validator(schema)
