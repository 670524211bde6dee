"""The device's main loop: connect, say hello, serve the bridge, reconnect forever.

Runs unchanged on the ESP32, the unix port and CPython (the desktop simulator). Everything it
touches is injected: the config dict, the HAL, a populated McpServer, and a transport factory
`factory(url, headers)` returning an object with the WsTransport interface.

Incoming messages (protocol reference §3.2): `mcp` payloads go to the MCP server and replies go
back in an envelope with the session id; async tool calls run in their own task (a slow tool
never blocks the link) and a `notifications/cancelled` for one cancels it without a reply;
`stt`, `tts` sentence_start and `alert` texts and the `llm` emotion are shown on the HAL; `system`
reboot reboots. Anything else (bad JSON, unknown types) is logged in one line and dropped.

Voice (voice.py), when the HAL has a microphone or a speaker: the hello announces PCM16 (no Opus
here), `tts` start/stop drive the turn, binary frames (framed by the protocol version) go to
the speaker while speaking; those that arrive outside speaking are counted and the first one
is logged.
"""

import asyncio
import gc
import random

import protocol
from compat import const

HELLO_TIMEOUT_S = 10
_LARGE_MESSAGE = const(4096)  # collect garbage after messages this big (parsed JSON is ~2-3x)
_PREVIEW = const(60)
_INTERNAL_ERROR = const(-32603)


class _LinkError(Exception):
    """The session ended for a reason worth one log line."""


class App:
    def __init__(self, config, hal, server, transport_factory, log=print):
        self.hal = hal
        self.server = server
        self.transport_factory = transport_factory
        self.log = log
        self.url = config["url"]
        self.protocol_version = config.get("protocol_version") or 1
        self.headers = protocol.handshake_headers(
            config.get("token") or "",
            config["device_id"],
            config["client_id"],
            self.protocol_version,
        )
        self.reconnect_min_s = float(config.get("reconnect_min_s", 1))
        self.reconnect_max_s = max(float(config.get("reconnect_max_s", 30)), self.reconnect_min_s)
        self.connected = False  # TCP + WebSocket up
        self.session_id = ""
        self.ready_event = asyncio.Event()  # set while a server hello has been received
        self.connections = 0  # successful WebSocket upgrades
        self.last_error = None  # why the last session ended or failed, e.g. "rejected: HTTP 401"
        self.ignored_binary = 0
        self.voice = _make_voice(config.get("voice") or {}, hal, self, log)
        self._transport = None
        self._calls = {}  # JSON-RPC id -> task of a running async tool call
        self._stopping = False
        self._wake = asyncio.Event()
        self._closer = None

    @property
    def pending_calls(self) -> int:
        return len(self._calls)

    # ---- lifecycle --------------------------------------------------------------------------

    async def run(self):
        """Connect, hello, serve; after any disconnect or failure wait and start again."""
        delay = self.reconnect_min_s
        while not self._stopping:
            try:
                if await self._session():
                    delay = self.reconnect_min_s
                if self._stopping:
                    break
                pause = self._jittered(delay)
                self.log("link: " + str(self.last_error) + "; reconnecting in %.1f s" % pause)
            except MemoryError:  # even the log line can fail on an exhausted heap
                gc.collect()
                pause = delay
            await self._pause(pause)
            delay = min(delay * 2, self.reconnect_max_s)

    def stop(self):
        """Make run() return soon: close the link and skip any pending reconnect wait."""
        self._stopping = True
        self._wake.set()
        if self._transport is not None:
            self._closer = asyncio.create_task(self._transport.close())

    def _jittered(self, delay):
        # Up to 20% either way, so a fleet that lost the bridge together does not return together.
        spread = 0.8 + 0.4 * random.getrandbits(16) / 65536
        return min(max(delay * spread, self.reconnect_min_s), self.reconnect_max_s)

    async def _pause(self, seconds):
        try:
            await asyncio.wait_for(_wait_event(self._wake), seconds)
        except asyncio.TimeoutError:
            pass

    async def _session(self) -> bool:
        """One connection from connect to disconnect; True if the server hello arrived."""
        transport = None
        had_hello = False
        try:
            transport = self._transport = self.transport_factory(self.url, self.headers)
            await transport.connect()
            self.connections += 1
            self.connected = True
            if self._stopping:
                raise _LinkError("stopped")
            self.log("link: connected to " + self.url)
            had_hello = await self._open_session(transport)
            self.last_error = await self._serve(transport)
        except MemoryError:
            gc.collect()
            self.last_error = "out of memory"
        except _LinkError as error:
            self.last_error = str(error)
        except Exception as error:  # any failure means: drop this link and reconnect
            phase = "session failed" if self.connected else "connect failed"
            self.last_error = phase + ": " + _describe(error)
        finally:
            await self._end_session(transport)
        return had_hello

    async def _open_session(self, transport) -> bool:
        """Say hello and wait for the server's (a persistent link overrides this: app_mqtt)."""
        await transport.send(
            protocol.device_hello(self.protocol_version, audio_params=protocol.PCM16_PARAMS)
        )
        hello = await self._await_hello(transport)
        self.log("link: session " + self.session_id + " ready")
        if self.voice is not None:
            self.voice.open(*protocol.downlink_audio(hello))
        return True

    async def _end_session(self, transport):
        self.connected = False
        self.ready_event.clear()
        if self.voice is not None:
            self.voice.close()
        calls, self._calls = self._calls, {}
        for task in calls.values():
            task.cancel()  # their replies could only go to a dead link
        self._transport = None
        if transport is not None:
            try:
                await transport.close()
            except Exception:  # the link is being dropped anyway
                pass

    async def _await_hello(self, transport):
        try:
            hello = await asyncio.wait_for(self._read_hello(transport), HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise _LinkError("no server hello within " + str(HELLO_TIMEOUT_S) + " s")
        session_id = hello.get("session_id")
        self.session_id = session_id if isinstance(session_id, str) else ""
        self.ready_event.set()
        return hello

    async def _read_hello(self, transport):
        while True:
            message = await transport.receive()
            if message is None:
                raise _LinkError("closed by the server before its hello")
            parsed = protocol.parse(message) if isinstance(message, str) else None
            if parsed is not None and protocol.is_server_hello(parsed):
                return parsed
            self._ignore("message before the server hello", message)

    async def _serve(self, transport):
        """Handle messages until the link ends; returns why it ended."""
        while not self._stopping:
            try:
                message = await transport.receive()
            except ValueError as error:  # protocol violation; the transport has closed the link
                return "protocol error: " + str(error)
            if message is None:
                code = getattr(transport, "close_code", None)
                return "closed by the server" + (" (code " + str(code) + ")" if code else "")
            try:
                await self._dispatch(transport, message)
            except MemoryError:
                gc.collect()
                self.log("link: out of memory handling a message; dropped it")
            except Exception as error:  # one bad message must not end the session
                self.log("link: message handling failed: " + _describe(error))
            if len(message) > _LARGE_MESSAGE:
                gc.collect()
        return "stopped"

    # ---- incoming messages ------------------------------------------------------------------

    async def _dispatch(self, transport, message):
        if not isinstance(message, str):
            self._on_audio(protocol.unpack_audio(self.protocol_version, message), message)
            return
        msg = protocol.parse(message)
        if msg is None:
            self._ignore("invalid message", message)
            return
        kind = msg["type"]
        if kind == "mcp":
            await self._on_mcp(transport, msg.get("payload"))
        elif kind == "system":
            self._on_system(msg)
        elif kind == "hello":  # stock re-reads a later hello on the same socket
            session_id = msg.get("session_id")
            if isinstance(session_id, str):
                self.session_id = session_id
        elif not self._show_message(kind, msg):
            self._ignore("message type " + kind, message)

    def _show_message(self, kind, msg) -> bool:
        """Show stt/tts/alert/llm content; False for a type the device does not know."""
        if kind == "stt":
            self._show("user", msg.get("text"))
        elif kind == "tts":
            state = msg.get("state")
            if state == "sentence_start":
                self._show("assistant", msg.get("text"))
            elif self.voice is not None:
                self.voice.on_tts(state)
        elif kind == "alert":
            status, text = msg.get("status"), msg.get("message")
            if isinstance(status, str) and isinstance(text, str):
                self._show("alert", status + ": " + text)
        elif kind == "llm":
            emotion = msg.get("emotion")
            if isinstance(emotion, str):
                self._show("system", "emotion: " + emotion)
        else:
            return False
        return True

    def _show(self, role, text):
        if isinstance(text, str):
            self.hal.show(role, text)

    def _on_system(self, msg):
        command = msg.get("command")
        if command == "reboot":
            self.log("link: reboot requested by the server")
            self.hal.reboot()
        else:
            self.log("link: ignored system command " + repr(command))

    async def _on_mcp(self, transport, payload):
        if isinstance(payload, dict) and payload.get("method") == "notifications/cancelled":
            self._cancel_call(payload.get("params"))
            return
        try:
            reply = self.server.handle_message(payload)
        except MemoryError:  # e.g. building a tools/list page: answer rather than let it time out
            gc.collect()
            request_id = payload.get("id") if isinstance(payload, dict) else None
            if request_id is None:
                raise
            self.log("link: out of memory handling request " + str(request_id))
            reply = _error_reply(request_id, "Out of memory")
        if reply is None:
            return
        if isinstance(reply, dict):
            await self._send_reply(transport, reply)
        else:  # an AsyncCall: run it beside the receive loop
            self._calls[reply.id] = asyncio.create_task(self._run_call(transport, reply))

    def _cancel_call(self, params):
        request_id = params.get("requestId") if isinstance(params, dict) else None
        if not isinstance(request_id, (int, str)):
            return
        task = self._calls.pop(request_id, None)
        if task is not None:
            task.cancel()
            self.log("link: call " + str(request_id) + " cancelled by the server")

    async def _run_call(self, transport, call):
        try:
            reply = await call.run()
            if self._calls.get(call.id) is asyncio.current_task():
                del self._calls[call.id]
            await self._send_reply(transport, reply)
        except MemoryError:
            gc.collect()
            self.log("link: out of memory replying to call " + str(call.id))
        except Exception as error:  # the link went down; nobody is left to answer
            self.log("link: reply to call " + str(call.id) + " lost: " + _describe(error))

    async def _send_reply(self, transport, reply):
        """Send an MCP reply; if it cannot go out, send a small error so the bridge needn't wait."""
        request_id = reply.get("id")
        try:
            await transport.send(protocol.mcp_envelope(self.session_id, reply))
            return
        except MemoryError:
            problem = "Out of memory sending the reply"
        except ValueError as error:  # over the 65 535-byte frame limit
            problem = str(error)
        gc.collect()
        self.log("link: reply to " + str(request_id) + " not sent: " + problem)
        failure = _error_reply(request_id, problem)
        await transport.send(protocol.mcp_envelope(self.session_id, failure))

    def _ignore(self, what, message):
        self.log("link: ignored " + what + ": " + repr(message[:_PREVIEW]))

    def _on_audio(self, payload, message):
        """One downlink audio payload (None: its header was wrong)."""
        voice = self.voice
        if payload is not None and voice is not None and voice.accept_audio(payload):
            return
        if not self.ignored_binary:
            why = "outside speaking" if payload is not None else "with a bad header"
            self.log("link: ignoring binary frames " + why + ", first: %d bytes" % len(message))
        self.ignored_binary += 1

    # ---- the voice link (voice.py) -----------------------------------------------------------

    async def voice_send(self, text):
        """Send a listen/abort message of the voice turn; OSError without a session."""
        transport = self._transport
        if transport is None or not self.ready_event.is_set():
            raise OSError("no session")
        await transport.send(text)

    async def voice_audio(self, pcm):
        """Send one microphone frame, framed for the protocol version."""
        transport = self._transport
        if transport is None or not self.ready_event.is_set():
            raise OSError("no session")
        await transport.send(protocol.pack_audio(self.protocol_version, pcm))

    # ---- text input -------------------------------------------------------------------------

    async def send_text(self, text) -> bool:
        """Send typed text as a `listen detect` message; False if there is no session."""
        transport = self._transport
        if transport is None or not self.ready_event.is_set():
            self.log("link: not connected; text not sent")
            return False
        try:
            await transport.send(protocol.listen_detect(self.session_id, text))
        except Exception as error:  # OSError: link lost; ValueError: text too long
            self.log("link: text not sent: " + _describe(error))
            return False
        return True


async def console_input(app, reader):
    """Send every non-empty line from reader (e.g. asyncio.StreamReader(sys.stdin)) as text."""
    while True:
        line = await reader.readline()
        if not line:
            return
        try:
            text = str(line, "utf-8").strip()
        except UnicodeError:
            app.log("console: input is not UTF-8; line ignored")
            continue
        if text:
            await app.send_text(text)


def _make_voice(config, hal, link, log):
    """The voice turn if the HAL has a microphone or a speaker and voice is not "off"."""
    mode = config.get("mode") or "auto"
    has_audio = getattr(hal, "microphone", None) or getattr(hal, "speaker", None)
    if mode == "off" or not has_audio:
        return None
    # Imported only for a board with audio: a device-sized heap has no room to spare for it.
    from audio import QUEUE_FRAMES
    from voice import Voice

    return Voice(hal, link, mode, int(config.get("queue_frames") or QUEUE_FRAMES), log)


def _error_reply(request_id, message) -> dict:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "error": {"code": _INTERNAL_ERROR, "message": message},
    }


async def _wait_event(event):
    await event.wait()


def _describe(error) -> str:
    text = str(error)
    name = type(error).__name__
    return name + ": " + text if text else name
