"""Admin API: list devices (live and remembered) and their tools, call a tool, forget a device.

Bearer admin token or API key on every route but `/healthz`, each route requiring its scope
(backend/api/scopes.py); errors are JSON `{"error": {"code", "message"}}` with the status and
code of `backend.api.errors.ERROR_TABLE`. The front ends (keys, chat, `/mcp`) come in as extra
routers and routes from the bridge.
"""

import json
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any

import structlog
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Route

from backend import __version__
from backend.api.errors import http_status
from backend.api.gate import OPEN_PATHS, AdminGate
from backend.api.scopes import actor_of, needs, principal_of
from backend.devices import DeviceRegistry, DeviceState
from backend.devices.registry import LIVE_STATES, is_user_only, iso_time
from backend.errors import BridgeError
from backend.keys import Principal, Scope
from backend.mcp_session import Tool

log = structlog.get_logger("api")

MAX_PAGE = 10_000
CALL_PATH = "/api/devices/{device_id}/tools/call"


class ApiError(Exception):
    """An HTTP-level refusal (auth, request shape) with its own status and code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ToolCallRequest(BaseModel):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0, le=600)
    confirm: bool = False  # a risky tool (reboot, upgrade, settings) runs only with it


class ToolCallResponse(BaseModel):
    content: list[dict[str, Any]]
    isError: bool
    duration_ms: float


class DeviceList(BaseModel):
    devices: list[dict[str, Any]]
    next_cursor: str | None
    total: int


class ToolList(BaseModel):
    device_id: str
    state: str
    cached: bool
    read_at: str | None
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
) -> FastAPI:
    """The HTTP API; every route but the open ones sits behind `AdminGate`, which resolves
    the admin token and (with `resolve_key`) API keys to principals."""
    app = FastAPI(title="esp32-mcp-bridge admin API", version=__version__)
    _install_error_handlers(app)
    app.add_middleware(
        AdminGate, admin_token=admin_token, max_body_bytes=max_body_bytes, resolve_key=resolve_key
    )
    _declare_bearer_auth(app)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "devices": len(registry), "known_devices": registry.known_count}

    @app.get("/api/devices")
    async def list_devices(
        principal: Reader,
        state: Annotated[list[DeviceState] | None, Query(description="only these states")] = None,
        online: Annotated[bool | None, Query(description="only live (or offline) ones")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1000,
        cursor: Annotated[str | None, Query(description="next_cursor of the page before")] = None,
    ) -> DeviceList:
        states = frozenset(state) if state else None
        if online is not None:
            wanted = LIVE_STATES if online else frozenset({DeviceState.OFFLINE})
            states = wanted if states is None else states & wanted
        if principal.device_ids is not None and not principal.is_admin:
            return _limited_listing(registry, principal.device_ids, states, cursor, limit)
        page = registry.listing(states=states, after=cursor, limit=limit)
        return DeviceList(devices=page.devices, next_cursor=page.next_cursor, total=page.total)

    @app.get("/api/devices/{device_id}")
    async def get_device(device_id: str, principal: Reader) -> dict[str, Any]:
        principal.require_read(device_id)
        return registry.summary(device_id)

    @app.delete("/api/devices/{device_id}", status_code=204)
    async def forget_device(device_id: str, _admin: Admin) -> Response:
        registry.forget(device_id)
        return Response(status_code=204)

    @app.get("/api/devices/{device_id}/tools")
    async def list_tools(
        device_id: str,
        principal: Reader,
        user: Annotated[bool, Query(description="include user-only tools")] = True,
    ) -> ToolList:
        principal.require_read(device_id)
        device = registry.get(device_id)
        if device is not None:
            record = registry.record(device_id)
            return ToolList(
                device_id=device_id,
                state=device.state.value,
                cached=False,
                read_at=iso_time(record.tools_read_at if record else None),
                tools=[_tool_json(t) for t in device.tool_list(include_user_only=user)],
            )
        record = registry.require_record(device_id)
        tools = [t for t in record.tools.tools if user or not is_user_only(t)]
        return ToolList(
            device_id=device_id,
            state=DeviceState.OFFLINE.value,
            cached=True,
            read_at=iso_time(record.tools_read_at),
            tools=[_tool_json(t) for t in tools],
        )

    async def call_tool(request: Request) -> Response:
        """`POST /api/devices/{device_id}/tools/call`, the hot path of the admin API."""
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
            raise ApiError(422, "invalid_request", _first_error(exc)) from None
        try:
            device = registry.require(device_id)
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

    # A plain Starlette route, first in the list: no dependency solving and no generic body and
    # response handling on the path every tool call takes (it halved the API's own overhead).
    # The FastAPI declaration below only documents it in the OpenAPI schema; it is never reached.
    app.router.routes.insert(0, Route(CALL_PATH, call_tool, methods=["POST"]))

    @app.post(
        CALL_PATH,
        response_model=ToolCallResponse,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _CALL_SCHEMA}},
            }
        },
    )
    async def call_tool_documented(device_id: str, request: Request) -> Response:
        return await call_tool(request)

    for router in routers:
        app.include_router(router)
    app.router.routes.extend(routes)
    return app


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


def _tool_json(tool: Tool) -> dict[str, Any]:
    return {
        "name": tool.name,
        "description": tool.description,
        "inputSchema": tool.input_schema,
        "annotations": tool.annotations,
    }


def _first_error(exc: ValidationError) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def _declare_bearer_auth(app: FastAPI) -> None:
    """Say in the OpenAPI description that every route but the open ones needs the token."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"}
        }
        for path, operations in schema.get("paths", {}).items():
            if path in OPEN_PATHS:
                continue
            for operation in operations.values():
                operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.code, str(exc))

    @app.exception_handler(BridgeError)
    async def bridge_error(_request: Request, exc: BridgeError) -> JSONResponse:
        status, code = http_status(exc)
        return _error(status, code, str(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        if first["type"] == "string_unicode":  # a lone surrogate: invalid text, as chat says
            return _error(400, "invalid_text", f"{where}: a lone surrogate is not Unicode text")
        return _error(422, "invalid_request", f"{where}: {first['msg']}" if where else first["msg"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http_error", str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug: logged with its traceback, answered in the API's one error shape.
        log.error("unexpected error in the admin API", path=request.url.path, exc_info=exc)
        return _error(500, "internal_error", "internal error (logged by the bridge)")
