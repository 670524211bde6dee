"""One device link, independent of the transport that carries it.

`DeviceSession` is the `LinkHandler` a transport feeds (`on_text`, `on_audio`, `on_closed`) and
the `DeviceConnection` the registry holds. It answers the hello, runs the MCP handshake
(initialize → notifications/initialized → paginated tools/list) and reports each outcome to the
registry, which owns the device's state. Listen, abort and audio go to the pipelines subscribed
on the `ConversationHub`; they answer through the session's `Conversation`.

On a conversation-scoped link (stock WebSocket) the device must say hello first and MCP starts
after it; on a persistent link (MQTT) MCP starts at once and every hello opens a new
conversation with a new session id. One bad message is logged (within a budget) and dropped,
never fatal.
"""

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog

from backend.common import excerpt
from backend.config import Settings
from backend.devices.conversation import Conversation, ConversationHub, HandlerResult
from backend.devices.device import Device
from backend.devices.limits import InboundLimit
from backend.devices.registry import DeviceRegistry
from backend.devices.state import DeviceState
from backend.logs import DeviceBudgets, DeviceLog, LogBudget
from backend.mcp_session import DeviceDisconnected, McpClient, McpError, TimeoutPolicy, Tool
from backend.mcp_session.models import ToolLimits
from backend.metrics import link_metrics, record_tool_relist
from backend.protocol import (
    Abort,
    AudioFrame,
    AudioParams,
    DeviceHello,
    Goodbye,
    Listen,
    ParseError,
    ServerGoodbye,
    ServerHello,
    ServerMessage,
    downlink_params,
)
from backend.protocol.messages import decode_device_message, device_message, mcp_envelope
from backend.transports.base import DeviceLink

log = structlog.get_logger("device")

NO_HELLO_CLOSE = 1008
POLICY_VIOLATION = 1008
# Re-listing tools after `notifications/tools/list_changed`: one at a time, at most this often.
RELIST_INTERVAL_S = 2.0
# Pipeline handlers running at once for one device; more messages are dropped (and counted).
MAX_HANDLER_TASKS = 8
INBOUND_RATE = "inbound rate limit exceeded"  # the other cut-off: the MCP client's violations


def new_session_id() -> str:
    """A fresh random session id (hex only: stock firmware puts it in JSON unescaped)."""
    # Hex only: stock firmware concatenates it into JSON without escaping.
    return secrets.token_hex(16)


class DeviceSession:
    """The conversation with one device over one link."""

    __slots__ = (
        "_closed",
        "_closing",
        "_cut_off",
        "_device",
        "_drops",
        "_handler_tasks",
        "_hello_timer",
        "_hub",
        "_in_conversation",
        "_inbound",
        "_last_relist",
        "_log",
        "_log_budgets",
        "_metrics",
        "_registry",
        "_relist_task",
        "_relist_wanted",
        "_session_id",
        "_settings",
        "_tasks",
        "conversation",
        "hello",
        "link",
        "mcp",
    )

    def __init__(
        self,
        link: DeviceLink,
        registry: DeviceRegistry,
        hub: ConversationHub,
        settings: Settings,
        timeouts: TimeoutPolicy | None = None,
        log_budgets: DeviceBudgets | None = None,
        vision: Callable[[str], dict[str, str] | None] | None = None,
    ) -> None:
        identity = link.identity
        self.link = link
        self._registry = registry
        self._hub = hub
        self._settings = settings
        self._session_id = new_session_id()
        self._metrics = link_metrics(identity.transport)  # bound once per link
        self._log = DeviceLog(log, identity.device_id, self._session_id)
        self.hello: DeviceHello | None = None  # the first hello (MCP, features); kept after it
        self._in_conversation = False  # from a hello until its goodbye (or the link's end)
        self.mcp = McpClient(
            self._send_mcp,
            timeouts=timeouts if timeouts is not None else timeout_policy(settings),
            vision=(
                vision(identity.device_id) if vision is not None else _vision_capability(settings)
            ),
            on_tools_changed=self._on_tools_changed,
            on_violation=self._cut_off_for,
            log=self._log,
        )
        self.conversation = Conversation(identity.device_id, self)
        self._device: Device | None = None
        self._tasks: set[asyncio.Task[Any]] | None = None  # created on first use
        self._handler_tasks = 0
        self._hello_timer: asyncio.TimerHandle | None = None
        self._drops: LogBudget | None = None
        self._log_budgets = log_budgets  # shared by the device's links (None: one per link)
        self._relist_task: asyncio.Task[None] | None = None
        self._relist_wanted = False
        self._last_relist = 0.0
        self._closing: asyncio.Task[None] | None = None
        self._closed = False
        self._cut_off = False
        self._inbound = InboundLimit(
            settings.max_inbound_messages_per_s,
            settings.max_inbound_bytes_per_s,
            reply_bytes=settings.max_message_bytes,
        )

    def start(self) -> None:
        """Register with the registry (replacing an older link) and begin the conversation."""
        self._device = self._registry.connect(self.link.identity, self)
        identity = self.link.identity
        # At debug: "device ready" and "device disconnected" tell an operator what matters, so
        # a link that never gets anywhere costs one info line, not two.
        self._log.debug("device connected", transport=identity.transport, remote=identity.remote)
        if self.link.conversation_scoped:
            self._hello_timer = asyncio.get_running_loop().call_later(
                self._settings.hello_timeout_s, self._on_hello_timeout
            )
        else:
            self._begin_mcp()

    @property
    def device(self) -> Device:
        """The registry's device for this link; only valid after `start`."""
        assert self._device is not None, "session not started"
        return self._device

    @property
    def session_id(self) -> str:
        """The session id sent in the hello reply."""
        return self._session_id

    @property
    def device_hello(self) -> DeviceHello | None:
        """The device's hello, once received."""
        return self.hello

    @property
    def downlink_audio(self) -> AudioParams:
        """What the server hello announced for the downlink (computed: nothing stored)."""
        uplink = self.hello.audio_params if self.hello is not None else AudioParams()
        frame_duration = self._settings.audio_frame_duration
        return downlink_params(uplink, self._settings.audio_sample_rate, frame_duration)

    # ---- inbound, called by the transport ------------------------------------------------------

    async def on_text(self, text: str) -> None:
        """Handle one text frame: rate-limit, decode, then route MCP, hello, listen or abort."""
        self._metrics.text_in.add(len(text))
        if not self._inbound.allow(len(text)):
            self._cut_off_for("inbound rate limit exceeded")
            return
        try:
            data = decode_device_message(text)
            if data["type"] == "mcp" and "payload" in data:
                # Every tool reply: straight to the MCP client, no model built on this path.
                self.mcp.feed(data["payload"])
                return
            message = device_message(data)
        except ParseError as exc:
            self._metrics.dropped("malformed")
            self._dropped("dropped device message", reason=excerpt(str(exc)), size=len(text))
            return
        if isinstance(message, DeviceHello):
            await self._on_hello(message)
        elif isinstance(message, Listen):
            self._chatter("listen", state=message.state, mode=message.mode, text=_clipped(message))
            for listen_handler in self._hub.listen_handlers():
                self._run_handler(listen_handler, message)
        elif isinstance(message, Abort):
            self._chatter("abort", reason=excerpt(message.reason) if message.reason else None)
            for abort_handler in self._hub.abort_handlers():
                self._run_handler(abort_handler, message)
        elif isinstance(message, Goodbye):
            await self._on_device_goodbye()

    def on_audio(self, frame: AudioFrame) -> None:
        """Handle one uplink audio frame: rate-limit it, drop it outside a conversation."""
        self._metrics.audio_in.add(len(frame.payload))
        if not self._inbound.charge(len(frame.payload)):
            self._cut_off_for("inbound rate limit exceeded")
            return
        if not self._in_conversation:
            self._metrics.dropped("outside_conversation")
            self._dropped("audio outside a conversation dropped", size=len(frame.payload))
            return
        self._hub.dispatch_audio(self.conversation, frame)

    def on_discarded(self, size: int) -> None:
        """A frame of `size` bytes that the transport could not hand over (audio that does not
        decode, text that is not UTF-8, a full queue): it was logged and dropped there, and it
        costs the device like any other frame, so junk cannot flood past the inbound limit.

        Not (yet) part of `LinkHandler` in `transports.base`: transports look it up on the
        handler they are given (see `transports.websocket`, `transports.mqtt`)."""
        if self._cut_off or self._closed:
            return
        self._metrics.dropped("transport")
        if not self._inbound.charge(size):
            self._cut_off_for("inbound rate limit exceeded")

    def on_closed(self, reason: str) -> None:
        """The link is gone: cancel this session's tasks and report it once to the registry."""
        if self._closed:
            return
        self._closed = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        for task in list(self._tasks or ()):
            task.cancel()
        self.mcp.close(reason)
        if self._device is not None:
            self._registry.disconnected(self._device, reason)
        if self._in_conversation:
            self._in_conversation = False
            self._hub.dispatch_ended(self.conversation, reason)
        if self._drops is not None:
            if self._log_budgets is None:
                self._drops.close()
            else:
                self._log_budgets.flush(self.link.identity.device_id)
        identity = self.link.identity
        self._lifecycle(
            "device disconnected",
            reason=reason,
            transport=identity.transport,
            remote=identity.remote,
        )

    def _cut_off_for(self, reason: str) -> None:
        """The device broke a bound (flooding, not reading our answers): close its link with
        1008 once, and ignore what it sends until the link is gone."""
        if self._cut_off:
            return
        self._cut_off = True
        self._metrics.cut_off("inbound_rate" if reason == INBOUND_RATE else "mcp_violation")
        self._log.warning("device cut off", reason=reason)
        self.disconnect(reason, POLICY_VIOLATION)

    # ---- called by the registry ----------------------------------------------------------------

    def disconnect(self, reason: str, code: int) -> None:
        """Fail pending calls with `reason` now; close the link in the background."""
        self.mcp.close(reason)
        if self._closing is None:
            self._closing = asyncio.create_task(self._close_link(code, reason))

    async def _close_link(self, code: int, reason: str) -> None:
        try:
            await self.link.close(code, reason)
        except Exception as exc:  # the link may already be gone
            self._log.debug("closing the link failed", error=repr(exc))

    # ---- conversation outbox (used by `Conversation`) ------------------------------------------

    async def send_message(self, message: ServerMessage) -> None:
        """Send one JSON message to the device, counting its size."""
        text = message.to_json()
        await self.link.send_text(text)
        self._metrics.text_out.add(len(text))

    async def send_audio(self, frame: AudioFrame) -> None:
        """Send one audio frame to the device, counting its size."""
        await self.link.send_audio(frame)
        self._metrics.audio_out.add(len(frame.payload))

    async def end_conversation(self) -> None:
        """End the conversation: close a per-conversation link, else send `goodbye`."""
        if self.link.conversation_scoped:
            await self.link.close(1000, "goodbye")
            return
        if not self._in_conversation:
            return  # nothing to end (a stale session id would only confuse the device)
        goodbye = ServerGoodbye(session_id=self._session_id).to_json()
        await self.link.send_text(goodbye)
        self._metrics.text_out.add(len(goodbye))
        self._conversation_over("goodbye from the bridge")

    # ---- hello ---------------------------------------------------------------------------------

    async def _on_hello(self, hello: DeviceHello) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        first = self.hello is None
        if not first and not self.link.conversation_scoped:
            # A persistent link: a new hello opens a new conversation and replaces a stale one.
            self._conversation_over("replaced by a new hello")
            self._session_id = new_session_id()
            self._log.session_id = self._session_id
        self.hello = hello
        self._in_conversation = True
        # The stock device waits 10 s for this reply; it goes out before any other work.
        server_hello = self._server_hello()
        await self.link.send_text(server_hello)
        self._metrics.text_out.add(len(server_hello))
        for opened_handler in self._hub.opened_handlers():
            self._run_handler(opened_handler, hello)
        if not first:
            self._log.info("repeated hello answered")
            return
        if not self.link.conversation_scoped:
            return  # MCP started when the link opened
        if hello.features.mcp:
            self._begin_mcp()
        else:
            self._log.info("device has no MCP server (no features.mcp in hello)")
            self._registry.ready(self.device, None, ())

    def _server_hello(self) -> str:
        params = self.downlink_audio
        fields = self.link.hello_fields(self._session_id)
        return ServerHello(session_id=self._session_id, audio_params=params, **fields).to_json()

    async def _on_device_goodbye(self) -> None:
        self._log.info("device said goodbye")
        if self.link.conversation_scoped:
            await self.link.close(1000, "goodbye")
        else:
            self._conversation_over("goodbye from the device")

    def _conversation_over(self, reason: str) -> None:
        """End the open conversation once: its `ended` event fires exactly once."""
        if not self._in_conversation:
            return
        self._in_conversation = False
        self.link.conversation_ended(self._session_id)
        self._hub.dispatch_ended(self.conversation, reason)

    def _on_hello_timeout(self) -> None:
        self._hello_timer = None
        timeout = self._settings.hello_timeout_s
        self._log.warning("no hello from device; closing", timeout_s=timeout)
        self._spawn(self.link.close(NO_HELLO_CLOSE, "no hello"))

    # ---- MCP handshake -------------------------------------------------------------------------

    def _begin_mcp(self) -> None:
        self._registry.initializing(self.device)
        self._spawn(self._initialize())

    async def _initialize(self) -> None:
        try:
            result = await self.mcp.initialize(timeout_s=self._settings.init_timeout_s)
            tools = await self._list_tools()
        except DeviceDisconnected:
            return
        except McpError as exc:
            self._log.warning(
                "MCP handshake failed; device stays connected", error=excerpt(str(exc))
            )
            self._registry.failed(self.device, str(exc))
            return
        self._last_relist = time.monotonic()
        identity = self.link.identity
        self._lifecycle(
            "device ready", tools=len(tools), transport=identity.transport, remote=identity.remote
        )
        self._registry.ready(self.device, result.server_info, tools)

    async def _list_tools(self) -> list[Tool]:
        settings = self._settings
        limits = ToolLimits(settings.max_tools_per_device, settings.max_tool_bytes_per_device)
        return await self.mcp.list_tools(with_user_tools=settings.list_user_tools, limits=limits)

    def _on_tools_changed(self) -> None:
        if self.device.state is not DeviceState.READY:
            return
        self._relist_wanted = True
        if self._relist_task is None:
            self._relist_task = self._spawn(self._relist())

    async def _relist(self) -> None:
        """Re-list tools while asked to: one request at a time, at most every few seconds, so a
        storm of `list_changed` notifications costs a handful of requests."""
        try:
            while self._relist_wanted:
                self._relist_wanted = False
                wait = self._last_relist + RELIST_INTERVAL_S - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                self._last_relist = time.monotonic()
                try:
                    tools = await self._list_tools()
                except McpError as exc:
                    self._log.warning("re-listing tools failed", error=excerpt(str(exc)))
                    record_tool_relist(ok=False)
                    continue
                record_tool_relist(ok=True)
                self._log.info("tool list read again", tools=len(tools))
                self._registry.tools_changed(self.device, tools)
        finally:
            self._relist_task = None

    # ---- outbound and housekeeping -------------------------------------------------------------

    async def _send_mcp(self, payload: dict[str, Any]) -> None:
        text = mcp_envelope(self._session_id, payload)
        await self.link.send_text(text)
        self._metrics.text_out.add(len(text))
        if "method" in payload and "id" in payload:
            self._inbound.expect_reply()

    def _run_handler(self, handler: Callable[[Conversation, Any], HandlerResult], arg: Any) -> None:
        """Call a pipeline's handler; a coroutine runs as a task of this session (bounded)."""
        try:
            outcome = handler(self.conversation, arg)
        except Exception:  # a pipeline's bug must not take the device link down
            self._log.exception("conversation handler failed")
            return
        if outcome is None:
            return
        if self._handler_tasks >= MAX_HANDLER_TASKS:
            if isinstance(outcome, Coroutine):
                outcome.close()
            self._metrics.dropped("pipeline_busy")
            self._dropped("pipeline busy; message dropped", limit=MAX_HANDLER_TASKS)
            return
        self._handler_tasks += 1
        task = self._spawn(_awaited(outcome))
        task.add_done_callback(self._handler_done)

    def _handler_done(self, task: asyncio.Task[Any]) -> None:
        self._handler_tasks -= 1
        if not task.cancelled() and task.exception() is not None:
            self._log.error("conversation handler failed", exc_info=task.exception())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        if self._tasks is None:
            self._tasks = set()
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _dropped(self, event: str, **fields: Any) -> None:
        self._budget().warning(event, **fields)

    def _lifecycle(self, event: str, **fields: Any) -> None:
        """A line the device earns by connecting, within the device's `LineRate` (shared by its
        links, so a reconnect loop writes a few lines a minute, not two per connection)."""
        budgets = self._log_budgets
        left_out = 0 if budgets is None else budgets.lifecycle.allow(self.link.identity.device_id)
        if left_out is None:
            return
        if left_out:
            fields["suppressed"] = left_out
        self._log.info(event, **fields)

    def _chatter(self, event: str, **fields: Any) -> None:
        """What a device says in a conversation, logged within the same per-link budget."""
        self._budget().info(event, **fields)

    def _budget(self) -> LogBudget:
        if self._drops is None:
            budgets = self._log_budgets
            device_id = self.link.identity.device_id
            self._drops = (
                LogBudget(self._log, burst=5)
                if budgets is None
                else budgets.get(device_id, self._log)
            )
        return self._drops


async def _awaited(outcome: Awaitable[None]) -> None:
    await outcome


def _clipped(message: Listen) -> str | None:
    return excerpt(message.text) if message.text is not None else None


def timeout_policy(settings: Settings) -> TimeoutPolicy:
    """The MCP reply deadlines of the settings (one object shared by every session)."""
    return TimeoutPolicy(default_s=settings.call_timeout_s, per_tool=dict(settings.tool_timeouts))


def _vision_capability(settings: Settings) -> dict[str, str] | None:
    if not settings.vision_url:
        return None
    vision = {"url": settings.vision_url}
    if settings.vision_token is not None:
        vision["token"] = settings.vision_token.get_secret_value()
    return vision
