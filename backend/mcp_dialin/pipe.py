"""An accepted WebSocket as the two memory streams an `mcp.ClientSession` talks through.

The xiaozhi "MCP endpoint" wire format is one JSON-RPC message per WebSocket **text** frame, no
envelope (what `mcp_pipe.py`, `mcp2xiaozhi` and `xiaozhi-client` send). The SDK's client session
sees a stream of `SessionMessage | Exception` to read and a stream of `SessionMessage` to write;
`websocket_streams` moves frames between those streams and the socket, the way the SDK's own
stdio transport moves lines.

A pipe that breaks the format is closed at once with a close code that says why (a broken pipe
is not worth talking to; dropping its frames would only turn its replies into timeouts):

- a binary frame: 1003 (unsupported data);
- a text frame over `max_frame_bytes`: 1009 (message too big);
- a text frame that is not one JSON-RPC message: 1007 (invalid payload).

A text frame of whitespace only is skipped: `mcp_pipe.py` relays every line its server prints,
blank ones included.

Closing the socket, for whatever reason, ends the read stream, so the session fails every
request still waiting ("connection closed") instead of leaving its caller hanging.
"""

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import mcp_types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.shared.message import SessionMessage
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_UNSUPPORTED = 1003
CLOSE_INVALID_PAYLOAD = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_TRY_AGAIN = 1013

ReadStream = MemoryObjectReceiveStream[SessionMessage | Exception]
WriteStream = MemoryObjectSendStream[SessionMessage]


@dataclass(slots=True)
class CloseInfo:
    """Why the socket ended: the code and reason we sent, or the peer's code."""

    code: int
    reason: str
    by_peer: bool


class WebSocketPipe:
    """The socket side of one dial-in: reads frames, writes messages, closes once."""

    def __init__(self, websocket: WebSocket, max_frame_bytes: int) -> None:
        self._ws = websocket
        self._max_frame_bytes = max_frame_bytes
        self.closed = anyio.Event()
        self.close_info: CloseInfo | None = None

    async def close(self, code: int, reason: str) -> None:
        """Close the socket with `code`/`reason` (the first close wins; later ones do nothing)."""
        if self.close_info is None:
            self.close_info = CloseInfo(code, reason, by_peer=False)
            if self._ws.application_state is WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):  # the peer may be gone already
                    await self._ws.close(code, reason[:120])  # a close reason is ≤ 123 bytes
        self.closed.set()

    def _peer_closed(self, code: int) -> None:
        if self.close_info is None:
            self.close_info = CloseInfo(code, "closed by the pipe", by_peer=True)
        self.closed.set()

    async def read_into(self, sink: MemoryObjectSendStream[SessionMessage | Exception]) -> None:
        """Feed every text frame to `sink` as a parsed message until the socket ends."""
        async with sink:
            while not self.closed.is_set():
                try:
                    frame = await self._ws.receive()
                except (WebSocketDisconnect, RuntimeError):
                    self._peer_closed(CLOSE_GOING_AWAY)
                    return
                if frame["type"] == "websocket.disconnect":
                    self._peer_closed(int(frame.get("code") or CLOSE_NORMAL))
                    return
                if _blank(frame):  # a pipe relaying an empty stdout line of its server
                    continue
                message = await self._parse(frame)
                if message is None:
                    return
                try:
                    await sink.send(message)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return  # the session has ended; the endpoint closes the socket

    async def _parse(self, frame: Mapping[str, Any]) -> SessionMessage | None:
        """The frame's message, or None after closing the socket for a frame that breaks the
        format."""
        text = frame.get("text")
        if not isinstance(text, str):
            await self.close(
                CLOSE_UNSUPPORTED, "binary frame: send one JSON-RPC message per text frame"
            )
            return None
        parsed = parse_frame(text, self._max_frame_bytes)
        if isinstance(parsed, CloseInfo):
            await self.close(parsed.code, parsed.reason)
            return None
        return parsed

    async def write_from(self, source: MemoryObjectReceiveStream[SessionMessage]) -> None:
        """Send every message the session writes as one text frame."""
        async with source:
            async for outgoing in source:
                text = outgoing.message.model_dump_json(by_alias=True, exclude_unset=True)
                try:
                    await self._ws.send_text(text)
                except (WebSocketDisconnect, RuntimeError, OSError):
                    self._peer_closed(CLOSE_GOING_AWAY)
                    return


def parse_frame(text: str, max_frame_bytes: int) -> SessionMessage | CloseInfo:
    """A text frame as the session's message, or why the socket is closed for it (1009: over
    `max_frame_bytes`, 1007: not one JSON-RPC message). Never raises."""
    # A character is at most 4 bytes: only count them when the text could be over the cap.
    if len(text) * 4 > max_frame_bytes and len(text.encode("utf-8", "replace")) > max_frame_bytes:
        return CloseInfo(CLOSE_TOO_BIG, f"frame larger than {max_frame_bytes} bytes", by_peer=False)
    try:
        parsed = mcp_types.jsonrpc_message_adapter.validate_json(text, by_name=False)
    except (ValueError, RecursionError):
        return CloseInfo(CLOSE_INVALID_PAYLOAD, "frame is not a JSON-RPC message", by_peer=False)
    return SessionMessage(parsed)


def _blank(frame: Mapping[str, Any]) -> bool:
    text = frame.get("text")
    return isinstance(text, str) and len(text) < 64 and not text.strip()


@contextlib.asynccontextmanager
async def websocket_streams(pipe: WebSocketPipe) -> AsyncIterator[tuple[ReadStream, WriteStream]]:
    """The (read, write) streams of an `mcp.ClientSession` over an accepted socket.

    On exit the pump tasks stop; the socket is left to the caller to close (with its reason).
    """
    read_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_reader = anyio.create_memory_object_stream[SessionMessage](0)
    async with anyio.create_task_group() as group:
        group.start_soon(pipe.read_into, read_writer)
        group.start_soon(pipe.write_from, write_reader)
        try:
            yield read_stream, write_stream
        finally:
            group.cancel_scope.cancel()
            for stream in (read_stream, write_stream, read_writer, write_reader):
                await stream.aclose()
