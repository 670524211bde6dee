"""A small stock-firmware MCP server for simulated voice devices (protocol reference §4).

Two tools, with the stock schemas and rules: `self.get_device_status` and
`self.audio_speaker.set_volume` {volume: integer 0..100}. Requests follow the firmware's
acceptance rules (§4.1): notifications and non-integer ids get no reply, unknown methods an
error without `code`. Every tools/call is recorded in `calls`.
"""

import json
from typing import Any

STATUS_TOOL = "self.get_device_status"
VOLUME_TOOL = "self.audio_speaker.set_volume"
SERVER_INFO = {"name": "bread-compact-wifi", "version": "2.4.2"}

TOOLS: list[dict[str, Any]] = [
    {
        "name": STATUS_TOOL,
        "description": "Get the device status (speaker volume).",
        "inputSchema": {"type": "object", "properties": {}},
    },
    {
        "name": VOLUME_TOOL,
        "description": "Set the volume of the audio speaker.",
        "inputSchema": {
            "type": "object",
            "properties": {"volume": {"type": "integer", "minimum": 0, "maximum": 100}},
            "required": ["volume"],
        },
    },
]

Json = dict[str, Any]


class DeviceMcp:
    """The device side of MCP as a function from a JSON-RPC request to its reply (or None)."""

    def __init__(self, volume: int = 70) -> None:
        self.volume = volume
        self.calls: list[tuple[str, Json]] = []

    def handle(self, request: Any) -> Json | None:
        if not isinstance(request, dict) or request.get("jsonrpc") != "2.0":
            return None
        method = request.get("method")
        if not isinstance(method, str) or method.startswith("notifications"):
            return None
        params = request.get("params", {})
        request_id = request.get("id")
        if (
            not isinstance(params, dict)
            or not isinstance(request_id, int)
            or isinstance(request_id, bool)
        ):
            return None  # the firmware drops these without a reply
        if method == "initialize":
            return _result(request_id, _initialize_result())
        if method == "tools/list":
            return _result(request_id, {"tools": TOOLS})
        if method == "tools/call":
            return self._call(request_id, params)
        return _error(request_id, f"Method not implemented: {method}")

    def _call(self, request_id: int, params: Json) -> Json:
        name = params.get("name")
        arguments = params.get("arguments", {})
        if not isinstance(name, str):
            return _error(request_id, "Missing name")
        if not isinstance(arguments, dict):
            return _error(request_id, "Invalid arguments")
        self.calls.append((name, arguments))
        if name == STATUS_TOOL:
            status = {"audio_speaker": {"volume": self.volume}}
            return _result(request_id, _text(json.dumps(status, separators=(",", ":"))))
        if name == VOLUME_TOOL:
            return self._set_volume(request_id, arguments.get("volume"))
        return _error(request_id, f"Unknown tool: {name}")

    def _set_volume(self, request_id: int, volume: Any) -> Json:
        if not isinstance(volume, int | float) or isinstance(volume, bool):
            return _error(request_id, "Missing valid argument: volume")
        if volume < 0:
            return _error(request_id, "Value is below minimum allowed: 0")
        if volume > 100:
            return _error(request_id, "Value exceeds maximum allowed: 100")
        self.volume = int(volume)  # the firmware truncates any JSON number
        return _result(request_id, _text("true"))


def _initialize_result() -> Json:
    return {
        "protocolVersion": "2024-11-05",
        "capabilities": {"tools": {}},
        "serverInfo": dict(SERVER_INFO),
    }


def _text(text: str) -> Json:
    return {"content": [{"type": "text", "text": text}], "isError": False}


def _result(request_id: int, result: Json) -> Json:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def _error(request_id: int, message: str) -> Json:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"message": message}}
