"""Every deliberate error maps to one HTTP status and one `error.code`, in this one table, and
every error body has OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

The lookup walks the exception's class hierarchy (most specific class first), so the order of the
table does not matter and a new subclass inherits its parent's mapping until it gets its own.
`type` follows from the status (OpenAI's names: `invalid_request_error`, `permission_error`,
`not_found_error`, `rate_limit_error`, `server_error`); `param` names the field at fault, as
OpenAI does (`messages`, `messages[0].role`), or is null. Under `/v1` (the OpenAI-compatible
routes) a request the bridge cannot accept is 400, never 422 (the openai SDKs raise
`BadRequestError` for 400 and `UnprocessableEntityError` for 422), and a bad key is
`invalid_api_key`; the admin routes keep 422 `invalid_request` and 401 `unauthorized`.
"""

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from backend.chat.errors import ConversationNotFound, InvalidConversationId
from backend.devices.errors import (
    ConfirmationRequired,
    DeviceBusy,
    DeviceElsewhere,
    DeviceNotReady,
    DeviceOffline,
    DeviceOnline,
    InvalidArguments,
    UnknownDevice,
    UnknownTool,
)
from backend.errors import BridgeError, MessageTooLarge
from backend.keys import InvalidKey, MissingScope, UnknownKey
from backend.mcp_session import (
    DeviceDisconnected,
    DeviceError,
    McpError,
    ProtocolViolation,
    RequestTimeout,
)
from backend.provisioning.errors import (
    AmbiguousActivation,
    InvalidInput,
    InvalidRelease,
    NotProvisioned,
    NotVerified,
    TooManyPending,
    UnknownActivation,
    UnknownEnrollment,
    UnknownRelease,
    UnknownSerialKey,
)
from backend.storage import DatabaseError

ERROR_TABLE: dict[type[BaseException], tuple[int, str]] = {
    InvalidKey: (401, "unauthorized"),
    MissingScope: (403, "forbidden"),
    UnknownDevice: (404, "unknown_device"),
    UnknownKey: (404, "unknown_key"),
    ConversationNotFound: (404, "unknown_conversation"),
    UnknownTool: (404, "unknown_tool"),
    DeviceNotReady: (409, "device_not_ready"),
    DeviceOnline: (409, "device_online"),
    DeviceElsewhere: (409, "device_elsewhere"),
    InvalidArguments: (422, "invalid_arguments"),
    MessageTooLarge: (413, "message_too_large"),
    InvalidConversationId: (422, "invalid_request"),
    DeviceBusy: (429, "device_busy"),
    ConfirmationRequired: (428, "confirmation_required"),
    UnknownActivation: (404, "unknown_activation"),
    UnknownEnrollment: (404, "unknown_enrollment"),
    UnknownRelease: (404, "unknown_release"),
    UnknownSerialKey: (404, "unknown_serial_key"),
    NotProvisioned: (404, "not_provisioned"),
    AmbiguousActivation: (409, "ambiguous_activation"),
    NotVerified: (409, "not_verified"),
    InvalidInput: (422, "invalid_request"),
    InvalidRelease: (422, "invalid_release"),
    TooManyPending: (503, "too_many_pending"),
    DeviceError: (502, "device_error"),
    ProtocolViolation: (502, "device_protocol_error"),
    McpError: (502, "device_protocol_error"),
    DeviceOffline: (503, "device_offline"),
    DeviceDisconnected: (503, "device_disconnected"),
    DatabaseError: (503, "storage_unavailable"),
    RequestTimeout: (504, "timeout"),
    BridgeError: (500, "internal_error"),
}


def http_status(error: BaseException) -> tuple[int, str]:
    """(status, code) for an error: its most specific class in the table."""
    for cls in type(error).__mro__:
        mapped = ERROR_TABLE.get(cls)
        if mapped is not None:
            return mapped
    return 500, "internal_error"


OPENAI_PREFIX = "/v1/"
# A 429 says when to come back: a device busy with max_pending_calls calls frees up in a moment.
RETRY_AFTER_S = 1

_TYPES = {
    401: "invalid_request_error",  # what OpenAI answers for a bad key (code invalid_api_key)
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    """OpenAI's `error.type` for a status: 5xx are `server_error`, other 4xx a bad request."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def openai_status(path: str, status: int, code: str) -> tuple[int, str]:
    """(status, code) as a route under `/v1` answers them: 422 becomes 400, 401 says the key."""
    if not path.startswith(OPENAI_PREFIX):
        return status, code
    if status == 422:
        return 400, code
    if status == 401:
        return 401, "invalid_api_key"
    return status, code


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON: `{"error": {message, type, param, code}}`."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def error_headers(status: int) -> dict[str, str]:
    """Headers an error of this status carries: 401 names the scheme, 429 when to retry."""
    if status == 401:
        return {"WWW-Authenticate": "Bearer"}
    if status == 429:
        return {"Retry-After": str(RETRY_AFTER_S)}
    return {}


def param_of(location: Sequence[int | str]) -> str | None:
    """A validation error's location as OpenAI's `param`: `messages[0].role`, `limit`.

    The first part (`body`, `query`, `path`, `header`) says where, not what, and is dropped."""
    parts = list(location)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


# ---- the schema of an error, for the OpenAPI document ----------------------------------------


class ErrorDetail(BaseModel):
    """The `error` object of every API error answer (OpenAI's shape)."""

    message: str = Field(description="what went wrong, for a person")
    type: str = Field(
        description="OpenAI's error type: invalid_request_error, permission_error, "
        "not_found_error, rate_limit_error or server_error"
    )
    param: str | None = Field(description="the request field at fault (messages[0].role), or null")
    code: str = Field(description="the bridge's error code (docs: the table of codes)")


class ErrorBody(BaseModel):
    """Every error the HTTP API answers (OpenAI's shape)."""

    error: ErrorDetail


_WHY = {
    400: "bad request (under /v1: any request the bridge cannot accept)",
    401: "missing or invalid token or API key",
    403: "the key lacks the route's scope or the device",
    404: "not found",
    409: "conflict with the current state",
    413: "request body too large",
    422: "malformed request (admin routes; /v1 answers 400)",
    428: "a risky tool needs confirm: true",
    429: "too many requests in flight; see Retry-After",
    500: "internal error (logged by the bridge)",
    502: "the device answered with an error or garbage",
    503: "unavailable: device offline or gone, storage down, too many pending",
    504: "the device did not answer in time",
}


def error_response(status: int) -> dict[str, Any]:
    """One OpenAPI response object for an error status, with the error schema."""
    response: dict[str, Any] = {"model": ErrorBody, "description": _WHY.get(status, "error")}
    if status == 429:
        response["headers"] = {
            "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}}
        }
    if status == 401:
        response["headers"] = {
            "WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}
        }
    return response


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: the error statuses it can answer beyond the ones every
    guarded route can (401, 403, 400/422, 413, 500; added to the document by app.py)."""
    return {status: error_response(status) for status in statuses}
