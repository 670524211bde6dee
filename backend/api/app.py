"""Admin API: list devices and their tools, call a tool. Bearer admin token on every route but
`/healthz`; errors are JSON `{"error": {"code", "message"}}`."""

import time
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend import __version__
from backend.auth import token_matches
from backend.devices import (
    DeviceBusy,
    DeviceNotReady,
    DeviceRegistry,
    InvalidArguments,
    UnknownDevice,
    UnknownTool,
)
from backend.devices.errors import DeviceLayerError
from backend.mcp_session import DeviceDisconnected, DeviceError, McpError, RequestTimeout, Tool

# Each error type has one HTTP status and one machine-readable code.
_ERRORS: list[tuple[type[Exception], int, str]] = [
    (UnknownDevice, 404, "unknown_device"),
    (UnknownTool, 404, "unknown_tool"),
    (InvalidArguments, 422, "invalid_arguments"),
    (DeviceNotReady, 409, "device_not_ready"),
    (DeviceBusy, 429, "device_busy"),
    (RequestTimeout, 504, "timeout"),
    (DeviceDisconnected, 503, "device_disconnected"),
    (DeviceError, 502, "device_error"),
    (McpError, 502, "device_protocol_error"),
]


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class ToolCallRequest(BaseModel):
    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)
    timeout_s: float | None = Field(default=None, gt=0, le=600)


class ToolCallResponse(BaseModel):
    content: list[dict[str, Any]]
    isError: bool
    duration_ms: float


def create_app(registry: DeviceRegistry, admin_token: str) -> FastAPI:
    app = FastAPI(title="esp32-mcp-bridge admin API", version=__version__)
    _install_error_handlers(app)

    def require_admin(request: Request) -> None:
        if not token_matches(request.headers.get("authorization"), admin_token):
            raise ApiError(401, "unauthorized", "missing or invalid admin token")

    admin = [Depends(require_admin)]

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "devices": len(registry)}

    @app.get("/api/devices", dependencies=admin)
    async def list_devices() -> list[dict[str, Any]]:
        return [device.summary() for device in registry]

    @app.get("/api/devices/{device_id}", dependencies=admin)
    async def get_device(device_id: str) -> dict[str, Any]:
        return registry.require(device_id).summary()

    @app.get("/api/devices/{device_id}/tools", dependencies=admin)
    async def list_tools(
        device_id: str,
        user: Annotated[bool, Query(description="include user-only tools")] = True,
    ) -> list[dict[str, Any]]:
        device = registry.require(device_id)
        return [_tool_json(tool) for tool in device.tool_list(include_user_only=user)]

    @app.post("/api/devices/{device_id}/tools/call", dependencies=admin)
    async def call_tool(device_id: str, call: ToolCallRequest) -> ToolCallResponse:
        device = registry.require(device_id)
        started = time.perf_counter()
        result = await device.call_tool(call.name, call.arguments, timeout_s=call.timeout_s)
        return ToolCallResponse(
            content=result.content,
            isError=result.is_error,
            duration_ms=round((time.perf_counter() - started) * 1000, 3),
        )

    return app


def _tool_json(tool: Tool) -> dict[str, Any]:
    return {
        "name": tool.name,
        "description": tool.description,
        "inputSchema": tool.input_schema,
        "annotations": tool.annotations,
    }


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.code, str(exc))

    @app.exception_handler(DeviceLayerError)
    @app.exception_handler(McpError)
    async def device_error(_request: Request, exc: Exception) -> JSONResponse:
        for kind, status, code in _ERRORS:
            if isinstance(exc, kind):
                return _error(status, code, str(exc))
        return _error(500, "internal_error", str(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return _error(422, "invalid_request", f"{where}: {first['msg']}" if where else first["msg"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, "http_error", str(exc.detail))
