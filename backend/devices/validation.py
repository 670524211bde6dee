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
    validator = _validator(json.dumps(schema, sort_keys=True))
    if validator is None:
        return None
    error = best_match(validator.iter_errors(arguments))
    if error is None:
        return None
    where = ".".join(str(part) for part in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


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
