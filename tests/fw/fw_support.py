"""Helpers shared by the firmware test modules (not a test module itself), and the stock tool
names, which the CPython tests of the same firmware import as tests.fw.fw_support."""

import json

# The stock tools with a full HAL, in registration order: those the model sees, then user-only.
MODEL_TOOLS = [
    "self.get_device_status",
    "self.audio_speaker.set_volume",
    "self.screen.set_brightness",
    "self.screen.set_theme",
    "self.led.set",
]
USER_TOOLS = ["self.get_system_info", "self.reboot"]


def request(method, params=None, request_id=1) -> dict:
    message = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        message["params"] = params
    return message


def call_tool(server, name, arguments=None, request_id=1):
    params = {"name": name}
    if arguments is not None:
        params["arguments"] = arguments
    return server.handle_message(request("tools/call", params, request_id))


def tool_text(reply) -> str:
    """The text of a successful tools/call reply; fails loudly on anything else."""
    result = reply["result"]
    assert result["isError"] is False, reply
    assert len(result["content"]) == 1, reply
    assert result["content"][0]["type"] == "text", reply
    return result["content"][0]["text"]


def error_of(reply):
    """(code, message) of an error reply."""
    assert "result" not in reply, reply
    return reply["error"]["code"], reply["error"]["message"]


def list_page(server, cursor=None, with_user_tools=None) -> dict:
    params = {}
    if cursor is not None:
        params["cursor"] = cursor
    if with_user_tools is not None:
        params["withUserTools"] = with_user_tools
    return server.handle_message(request("tools/list", params))["result"]


def all_tool_names(server, with_user_tools=None) -> list:
    """Names over every page, following nextCursor."""
    names = []
    cursor = None
    for _ in range(100):
        page = list_page(server, cursor, with_user_tools)
        names.extend(tool["name"] for tool in page["tools"])
        cursor = page.get("nextCursor")
        if cursor is None:
            return names
    raise AssertionError("tools/list never ended")


def utf8_len(value) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode("utf-8"))
