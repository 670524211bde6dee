"""Admin API: list devices (live and remembered) and their tools, call a tool, forget a device,
name it and keep notes on it.

Bearer admin token or API key on every route but the probes (`/livez`; `/readyz` and its alias
`/healthz`), each route requiring its scope (backend/api/scopes.py); errors are OpenAI's JSON
`{"error": {"message", "type", "param", "code"}}` with the status and code of
`backend.api.errors.ERROR_TABLE` (400 for any bad request under `/v1`). The front ends (keys,
chat, `/mcp`) come in as extra routers and routes from the bridge. The OpenAPI document lists
every error status of each route with that schema; CORS is off unless `cors_origins` lists
origins.
"""

import json
import time
import unicodedata
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match, Route

from backend import __version__
from backend.api.device_events import DeviceStreams
from backend.api.errors import (
    ErrorBody,
    error_body,
    error_headers,
    error_response,
    errors,
    http_status,
    openai_status,
    param_of,
)
from backend.api.gate import OPEN_PATHS, AdminGate
from backend.api.openapi import add_checked_constraints
from backend.api.scopes import actor_of, needs, principal_of
from backend.common import iso_time
from backend.devices import DeviceRegistry, DeviceState
from backend.devices.state import LIVE_STATES, UNSET, is_user_only
from backend.errors import BridgeError
from backend.keys import Principal, Scope
from backend.mcp_session import Tool

log = structlog.get_logger("api")

MAX_PAGE = 10_000
MAX_DEVICE_NAME = 64  # a device's display name: one line
MAX_DEVICE_NOTES = 2000  # an admin's notes on a device
CALL_PATH = "/api/devices/{device_id}/tools/call"


class ApiError(Exception):
    """An HTTP-level refusal (auth, request shape) with its own status and code."""

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param  # the request field at fault, as OpenAI's error.param


class ToolCallRequest(BaseModel):
    """The body of `POST /api/devices/{id}/tools/call`: tool, arguments, timeout (s), confirm."""

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0, le=600)
    confirm: bool = False  # a risky tool (reboot, upgrade, settings) runs only with it


class DeviceNotes(BaseModel):
    """The body of `PUT /api/devices/{id}/notes`: a display name (one line) and notes, each
    left as it is when absent, cleared by null or ""."""

    model_config = ConfigDict(extra="forbid")

    # The patterns say what `_device_name` and `_device_notes` check.
    name: str | None = Field(
        default=None,
        max_length=MAX_DEVICE_NAME,
        json_schema_extra={
            "pattern": "^[^\\u0000-\\u001f\\u007f-\\u009f\\u202a-\\u202e\\u2066-\\u2069]*$"
        },
    )
    notes: str | None = Field(
        default=None,
        max_length=MAX_DEVICE_NOTES,
        json_schema_extra={
            "pattern": "^[^\\u0000-\\u0008\\u000b\\u000c\\u000e-\\u001f\\u007f-\\u009f]*$"
        },
    )


class ToolCallResponse(BaseModel):
    """The device's tools/call result (MCP `content`, `isError`) and how long it took in ms."""

    content: list[dict[str, Any]]
    isError: bool
    duration_ms: float


class DeviceList(BaseModel):
    """One page of `GET /api/devices`: rows, the cursor of the next page, the total."""

    devices: list[dict[str, Any]] = Field(
        description="Device rows (`GET /api/devices/{device_id}`'s answer each); in a cluster a "
        "row's `instance` names the instance serving the device (null while offline), a single "
        "bridge's rows have no `instance`."
    )
    next_cursor: str | None
    total: int


class ToolList(BaseModel):
    """A device's tools; `cached` when the device is offline and they are the last ones read."""

    device_id: str
    state: str
    cached: bool
    read_at: str | None
    # MCP's tool fields, and `needs_confirmation`: a call is held until confirmed.
    tools: list[dict[str, Any]]


_CALL_REQUEST = TypeAdapter(ToolCallRequest)
_CALL_SCHEMA = ToolCallRequest.model_json_schema()


Reader = Annotated[Principal, Depends(needs(Scope.DEVICES_READ))]
Admin = Annotated[Principal, Depends(needs(Scope.ADMIN))]


def create_app(
    registry: DeviceRegistry,
    admin_token: str,
    *,
    max_body_bytes: int = 65536,
    resolve_key: Callable[[str], Principal | None] | None = None,
    routers: Iterable[APIRouter] = (),
    routes: Iterable[BaseRoute] = (),
    cors_origins: Iterable[str] = (),
    device_streams: DeviceStreams | None = None,
    health: Callable[[], str | None] = lambda: None,
) -> FastAPI:
    """The HTTP API; every route but the open ones sits behind `AdminGate`, which resolves
    the admin token and (with `resolve_key`) API keys to principals. With `cors_origins`, a
    browser page from those origins may call it (the preflight needs no key; the call does).
    `health` says why the bridge should get no new devices (None: ready)."""
    app = FastAPI(title="esp32-mcp-bridge admin API", version=__version__)
    app.state.registry = registry
    app.state.health = health
    _install_error_handlers(app)
    app.add_middleware(
        AdminGate, admin_token=admin_token, max_body_bytes=max_body_bytes, resolve_key=resolve_key
    )
    origins = list(cors_origins)
    if origins:  # added last, so outermost: it answers preflights before the gate asks for a key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "PUT", "PATCH", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["X-Conversation-Id", "Retry-After"],
        )
    _describe(app)
    # A plain Starlette route, first in the list: no dependency solving and no generic body and
    # response handling on the path every tool call takes (it halved the API's own overhead).
    # The FastAPI declaration in `router` only documents it in the OpenAPI schema.
    app.router.routes.append(Route(CALL_PATH, call_tool, methods=["POST"]))
    app.include_router(router)
    # The console's live fleet and whoami (backend/api/device_events.py).
    streams = device_streams if device_streams is not None else DeviceStreams(registry)
    app.state.device_streams = streams
    app.include_router(streams.router())
    for extra in routers:
        app.include_router(extra)
    app.router.routes.extend(routes)
    return app


# ---- the routes: each takes the registry from the app (`create_app` puts it there) -------------

router = APIRouter()


def registry_of(request: Request) -> DeviceRegistry:
    """The registry of the app serving the request."""
    registry: DeviceRegistry = request.app.state.registry
    return registry


Registry = Annotated[DeviceRegistry, Depends(registry_of)]


@router.get("/livez")
async def livez() -> dict[str, str]:
    """Liveness: answered on the event loop, so a 200 says the process and its loop work."""
    # Never 503 for the database or the broker: a Kubernetes liveness probe would restart every
    # instance at once during a database outage (docs/cluster.md).
    return {"status": "ok"}


def _readiness(request: Request) -> dict[str, Any] | JSONResponse:
    # Readiness, a load balancer's check: a 503 (draining, or a cluster instance fenced) sends
    # new devices to another instance (docs/cluster.md).
    problem = request.app.state.health()
    if problem is not None:
        return JSONResponse(error_body(503, "unavailable", problem), status_code=503)
    registry = registry_of(request)
    return {"status": "ok", "devices": len(registry), "known_devices": registry.known_count}


@router.get("/readyz", responses=errors(503), response_model=None)
async def readyz(request: Request) -> dict[str, Any] | JSONResponse:
    """Readiness: 503 while the bridge should get no new devices (draining, fenced)."""
    return _readiness(request)


@router.get("/healthz", responses=errors(503), response_model=None)
async def healthz(request: Request) -> dict[str, Any] | JSONResponse:
    """The alias of /readyz that balancers configured before it still check."""
    return _readiness(request)


@router.get("/api/devices")
async def list_devices(
    principal: Reader,
    registry: Registry,
    state: Annotated[list[DeviceState] | None, Query(description="only these states")] = None,
    online: Annotated[bool | None, Query(description="only live (or offline) ones")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1000,
    cursor: Annotated[str | None, Query(description="next_cursor of the page before")] = None,
) -> DeviceList:
    """Devices, live and remembered, a page at a time (a device-limited key sees its own)."""
    states = frozenset(state) if state else None
    if online is not None:
        wanted = LIVE_STATES if online else frozenset({DeviceState.OFFLINE})
        states = wanted if states is None else states & wanted
    if principal.device_ids is not None and not principal.is_admin:
        return _limited_listing(registry, principal.device_ids, states, cursor, limit)
    page = registry.listing(states=states, after=cursor, limit=limit)
    return DeviceList(devices=page.devices, next_cursor=page.next_cursor, total=page.total)


@router.get("/api/devices/{device_id}", responses=errors(404))
async def get_device(device_id: str, principal: Reader, registry: Registry) -> dict[str, Any]:
    """One device's row."""
    principal.require_read(device_id)
    return registry.summary(device_id)


@router.delete("/api/devices/{device_id}", status_code=204, responses=errors(404, 409, 503))
async def forget_device(device_id: str, _admin: Admin, registry: Registry) -> Response:
    """Forget an offline device and its cached tools (409 while it is connected)."""
    registry.forget(device_id)
    return Response(status_code=204)


@router.put("/api/devices/{device_id}/notes", responses=errors(404))
async def annotate_device(
    device_id: str, body: DeviceNotes, _admin: Admin, registry: Registry
) -> dict[str, Any]:
    """Set the device's display name and notes (shown in its row); answers the row."""
    given = body.model_fields_set
    registry.annotate(
        device_id,
        name=_device_name(body.name) if "name" in given else UNSET,
        notes=_device_notes(body.notes) if "notes" in given else UNSET,
    )
    log.info("device annotated", device_id=device_id, fields=sorted(given))
    return registry.summary(device_id)


@router.get("/api/devices/{device_id}/tools", responses=errors(404))
async def list_tools(
    device_id: str,
    principal: Reader,
    registry: Registry,
    user: Annotated[bool, Query(description="include user-only tools")] = True,
) -> ToolList:
    """A device's tools; an offline device's last ones read, marked `cached`."""
    principal.require_read(device_id)
    device = registry.get(device_id)
    if device is not None:
        record = registry.record(device_id)
        return ToolList(
            device_id=device_id,
            state=device.state.value,
            cached=False,
            read_at=iso_time(record.tools_read_at if record else None),
            tools=[
                _tool_json(t, registry.confirmation.reason(device_id, t))
                for t in device.tool_list(include_user_only=user)
            ],
        )
    record = registry.require_record(device_id)
    tools = [t for t in record.tools.tools if user or not is_user_only(t)]
    return ToolList(
        device_id=device_id,
        state=DeviceState.OFFLINE.value,
        cached=True,
        read_at=iso_time(record.tools_read_at),
        tools=[_tool_json(t, registry.confirmation.reason(device_id, t)) for t in tools],
    )


async def call_tool(request: Request) -> Response:
    """`POST /api/devices/{device_id}/tools/call`, the hot path of the admin API."""
    registry = registry_of(request)
    device_id = request.path_params["device_id"]
    principal = principal_of(request)
    actor = actor_of(principal)
    try:
        principal.require_call(device_id)  # before the body is read
    except BridgeError as exc:  # audited without the call, which nobody read
        registry.refuse_call(device_id, "", None, actor=actor, error=type(exc).__name__)
        raise
    try:
        call = _CALL_REQUEST.validate_json(await request.body())
    except ValidationError as exc:  # names no call: not audited, answered 422
        first = exc.errors(include_url=False)[0]
        raise ApiError(
            422, "invalid_request", _first_error(exc), param=param_of(first["loc"])
        ) from None
    try:
        device = await registry.require_ready(device_id)  # waits while it moves instance
    except BridgeError as exc:
        registry.refuse_call(
            device_id,
            call.name,
            call.arguments,
            actor=actor,
            error=type(exc).__name__,
            confirmed=call.confirm,
        )
        raise
    started = time.perf_counter()
    result = await device.call_tool(
        call.name,
        call.arguments,
        timeout_s=call.timeout_s,
        confirmed=call.confirm,
        actor=actor,
    )
    answer = {
        "content": result.content,
        "isError": result.is_error,
        "duration_ms": round((time.perf_counter() - started) * 1000, 3),
    }
    return Response(_JSON.encode(answer), media_type="application/json")


@router.post(
    CALL_PATH,
    response_model=ToolCallResponse,
    responses=errors(404, 409, 422, 428, 429, 502, 503, 504),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _CALL_SCHEMA}},
        }
    },
)
async def call_tool_documented(device_id: str, request: Request) -> Response:
    """Never reached: the plain route `create_app` puts first answers; this documents it."""
    return await call_tool(request)


def _limited_listing(
    registry: DeviceRegistry,
    device_ids: frozenset[str],
    states: frozenset[DeviceState] | None,
    cursor: str | None,
    limit: int,
) -> DeviceList:
    """The listing for a key limited to some devices: only those, paged the same way."""
    wanted = {state.value for state in states} if states is not None else None
    rows = [
        registry.summary(device_id)
        for device_id in sorted(device_ids)
        if registry.record(device_id) is not None or registry.get(device_id) is not None
    ]
    rows = [row for row in rows if wanted is None or row["state"] in wanted]
    start = (
        next((i for i, row in enumerate(rows) if row["device_id"] > cursor), len(rows))
        if cursor
        else 0
    )
    page = rows[start : start + limit]
    more = start + limit < len(rows) and page
    return DeviceList(
        devices=page, next_cursor=page[-1]["device_id"] if more else None, total=len(rows)
    )


# Bidirectional overrides and isolates: a name with them could show as another device's.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _device_name(value: str | None) -> str | None:
    """A display name on one line (runs of spaces as one); 422 for control characters."""
    if value is None:
        return None
    if any(unicodedata.category(c) == "Cc" or c in _BIDI_CONTROLS for c in value):
        message = "name: one line of visible text (no control or bidirectional characters)"
        raise ApiError(422, "invalid_request", message, param="name")
    return " ".join(value.split())


def _device_notes(value: str | None) -> str | None:
    """Notes with their line breaks as \\n; 422 for other control characters."""
    if value is None:
        return None
    notes = value.replace("\r\n", "\n").replace("\r", "\n").strip()
    if any(unicodedata.category(c) == "Cc" and c not in "\n\t" for c in notes):
        message = "notes: text with line breaks and tabs, no other control characters"
        raise ApiError(422, "invalid_request", message, param="notes")
    return notes


def _tool_json(tool: Tool, confirmation: str | None) -> dict[str, Any]:
    """A tool as MCP lists it, and whether the bridge holds a call of it for a confirmation
    (the console and the CLI mark such tools before they are used)."""
    return {
        "name": tool.name,
        "description": tool.description,
        "inputSchema": tool.input_schema,
        "annotations": tool.annotations,
        "needs_confirmation": confirmation is not None,
    }


def _first_error(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def _describe(app: FastAPI) -> None:
    """Make the OpenAPI document say what the routes do: every route but the open ones needs
    the token, and each operation lists the errors every guarded route can answer (401, 403,
    413 with a body, 400 or 422 for bad input, 500) in the one error schema, in place of
    FastAPI's own 422 schema, which this API never sends."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {})
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schemas = components.setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        error_schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error_schema.pop("$defs", {}))
        schemas["ErrorBody"] = error_schema
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                _describe_operation(path, operation)
        add_checked_constraints(schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _describe_operation(path: str, operation: dict[str, Any]) -> None:
    responses: dict[str, Any] = operation.setdefault("responses", {})
    statuses = {500}
    if path not in OPEN_PATHS:
        operation["security"] = [{"bearer": []}]
        statuses |= {401, 403}
    takes_input = "requestBody" in operation or bool(operation.get("parameters"))
    openai = path.startswith("/v1/")
    if takes_input or "422" in responses:
        # Under /v1 every bad request is 400; elsewhere a lone surrogate is 400, the rest 422.
        statuses |= {400} if openai else {400, 422}
    if openai:
        responses.pop("422", None)
    if "requestBody" in operation:
        statuses.add(413)
    for status in sorted(statuses):
        answer = error_response(status)
        declared = responses.setdefault(str(status), {"description": answer["description"]})
        declared["content"] = {
            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
        }
        if "headers" in answer:
            declared["headers"] = answer["headers"]


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _error(
    request: Request,
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    status, code = openai_status(request.url.path, status, code)
    return JSONResponse(
        error_body(status, code, message, param),
        status_code=status,
        headers={**error_headers(status), **(headers or {})},
    )


def _allowed_methods(app: FastAPI, request: Request) -> list[str]:
    """Every method some route takes at this path (a path may have a route per method, and
    included routers hide theirs), found by asking each route whether it takes the method."""
    return [
        method
        for method in _METHODS
        if any(
            route.matches({**request.scope, "method": method})[0] == Match.FULL
            for route in app.router.routes
        )
    ]


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(request, exc.status, exc.code, str(exc), exc.param)

    @app.exception_handler(BridgeError)
    async def bridge_error(request: Request, exc: BridgeError) -> JSONResponse:
        status, code = http_status(exc)
        return _error(request, status, code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = param_of(first["loc"])
        where = param or ""
        if first["type"] == "json_invalid":  # its loc is ("body", <character offset>)
            # json's reasons end where it would add the place ("Unterminated string starting at").
            reason = str((first.get("ctx") or {}).get("error") or "malformed").removesuffix(" at")
            at = first["loc"][-1] if isinstance(first["loc"][-1], int) else None
            message = f"request body is not valid JSON: {reason}"
            message += f" at position {at}" if at is not None else ""
            return _error(request, 422, "invalid_request", message, None)
        if first["type"] == "string_unicode":  # a lone surrogate: invalid text, as chat says
            message = f"{where}: a lone surrogate is not Unicode text"
            return _error(request, 400, "invalid_text", message, param)
        message = f"{where}: {first['msg']}" if where else first["msg"]
        return _error(request, 422, "invalid_request", message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette's Allow names the first route's methods only
            headers["Allow"] = ", ".join(_allowed_methods(app, request))
        return _error(request, exc.status_code, "http_error", str(exc.detail), None, headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug: logged with its traceback, answered in the API's one error shape.
        log.error("unexpected error in the admin API", path=request.url.path, exc_info=exc)
        return _error(request, 500, "internal_error", "internal error (logged by the bridge)")
