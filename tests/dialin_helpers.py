"""Helpers for the MCP dial-in tests: a raw JSON-RPC pipe and a loopback host for the endpoint.

`RawPipe` is what `mcp_pipe.py` does, written out: a `websockets` client that answers the
bridge's JSON-RPC requests itself (one message per text frame), so a test can make it slow,
silent or rude. `EndpointHost` serves `DialInEndpoint` alone with uvicorn on 127.0.0.1:0.
"""

import asyncio
import contextlib
import json
import socket
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from backend.keys import Principal, Scope
from backend.mcp_dialin.endpoint import DialInEndpoint, DialInLimits
from backend.mcp_servers.hub import McpServerHub

ECHO_TOOL = {
    "name": "echo",
    "description": "Echo the text back.",
    "inputSchema": {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    },
}

# A stdio MCP server for the stock pipe (xiaozhi-mcp) to relay: one tool, `add`.
STDIO_SERVER = textwrap.dedent(
    """
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("adder")

    @server.tool()
    def add(a: int, b: int) -> str:
        \"\"\"Add two whole numbers.\"\"\"
        return f"sum={a + b}"

    if __name__ == "__main__":
        server.run(transport="stdio")
    """
)


def write_stdio_server(folder: Path) -> dict[str, Any]:
    """Write the stdio server and an `mcp_config.json` naming it `adder`; returns the config."""
    script = folder / "adder_server.py"
    script.write_text(STDIO_SERVER)
    config = {
        "mcpServers": {"adder": {"type": "stdio", "command": sys.executable, "args": [str(script)]}}
    }
    (folder / "mcp_config.json").write_text(json.dumps(config))
    return config


class RawPipe:
    """A pipe speaking raw JSON-RPC; `calls` holds every tools/call it received."""

    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str] | None = None,
        tools: list[dict[str, Any]] | None = None,
        answer_initialize: bool = True,
        hold_calls: bool = False,
        refuse_initialize: bool = False,
    ) -> None:
        self.url = url
        self.headers = headers
        self.tools = tools if tools is not None else [ECHO_TOOL]
        self.answer_initialize = answer_initialize
        self.refuse_initialize = refuse_initialize  # answer initialize with an error
        self.hold_calls = hold_calls  # receive tools/call and never answer it
        self.calls: list[dict[str, Any]] = []
        self.call_seen = asyncio.Event()
        self.ws: ClientConnection | None = None
        self.closed: asyncio.Future[tuple[int | None, str]] = (
            asyncio.get_running_loop().create_future()
        )
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> "RawPipe":
        self.ws = await connect(self.url, additional_headers=self.headers, max_size=None)
        self._task = asyncio.create_task(self._serve())
        return self

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task

    async def close_info(self) -> tuple[int | None, str]:
        """(code, reason) of the close the bridge sent (waits for it)."""
        return await self.closed

    async def _serve(self) -> None:
        assert self.ws is not None
        try:
            async for frame in self.ws:
                message = json.loads(frame)
                reply = self.reply(message)
                if reply is not None:
                    await self.ws.send(json.dumps(reply))
        except ConnectionClosed:
            pass
        self._set_closed(self.ws.close_code, self.ws.close_reason or "")

    def _set_closed(self, code: int | None, reason: str) -> None:
        if not self.closed.done():
            self.closed.set_result((code, reason))

    def reply(self, message: dict[str, Any]) -> dict[str, Any] | None:
        method = message.get("method")
        if "id" not in message or method is None:
            return None  # a notification or a reply
        if method == "initialize":
            if self.refuse_initialize:
                error = {"code": -32602, "message": "unsupported protocol version"}
                return {"jsonrpc": "2.0", "id": message["id"], "error": error}
            if not self.answer_initialize:
                return None
            result: dict[str, Any] = {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": "raw-pipe", "version": "1"},
            }
        elif method == "tools/list":
            result = {"tools": self.tools}
        elif method == "tools/call":
            self.calls.append(message["params"])
            self.call_seen.set()
            if self.hold_calls:
                return None
            text = message["params"].get("arguments", {}).get("text", "")
            result = {"content": [{"type": "text", "text": f"echo: {text}"}], "isError": False}
        elif method == "ping":
            result = {}
        else:
            return {
                "jsonrpc": "2.0",
                "id": message["id"],
                "error": {"code": -32601, "message": "no"},
            }
        return {"jsonrpc": "2.0", "id": message["id"], "result": result}


async def closed_with(url: str, **kwargs: Any) -> tuple[int | None, str]:
    """Connect, send nothing, and return the (code, reason) the bridge closes with."""
    async with connect(url, **kwargs) as ws:
        with contextlib.suppress(ConnectionClosed):
            async for _frame in ws:
                pass
        return ws.close_code, ws.close_reason or ""


class EndpointHost:
    """`DialInEndpoint` alone in a Starlette app under uvicorn on loopback; keys are a dict."""

    def __init__(self, limits: DialInLimits | None = None) -> None:
        self.hub = McpServerHub()
        self.keys: dict[str, Principal] = {}
        self.endpoint = DialInEndpoint(self.hub, self._resolve, limits)
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None

    def add_key(
        self,
        token: str,
        *,
        scopes: frozenset[Scope] = frozenset({Scope.MCP_ENDPOINT}),
        devices: frozenset[str] | None = frozenset({"aa:bb:cc:dd:ee:01"}),
        key_id: str = "0123456789ab",
    ) -> str:
        self.keys[token] = Principal(key_id, f"key {key_id}", scopes, devices)
        return token

    def _resolve(self, token: str) -> Principal | None:
        if token.lower().startswith("bearer "):
            token = token[7:].strip()
        return self.keys.get(token)

    def url(self, token: str | None = None) -> str:
        assert self._socket is not None
        port = self._socket.getsockname()[1]
        query = f"?token={token}" if token is not None else ""
        return f"ws://127.0.0.1:{port}/v1/mcp-endpoint/{query}"

    async def start(self) -> "EndpointHost":
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(64)
        app = Starlette(routes=self.endpoint.routes)
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:  # noqa: ASYNC110 - uvicorn sets a flag, no event
            await asyncio.sleep(0.01)
        return self

    async def stop(self) -> None:
        await self.endpoint.stop()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task


async def wait_for(check: Callable[[], bool]) -> None:
    """Poll until `check` holds (pytest's timeout ends a test that waits forever)."""
    while not check():  # noqa: ASYNC110 - no event to wait on
        await asyncio.sleep(0.01)
