"""The talk page's device endpoint: a browser tab becomes a voice device (issue #19, item 5).

A page holding an API key with the scope `console:talk` asks `POST /api/console/talk` for a
ticket, then opens `ws(s)://<admin listener>/console/device?ticket=<ticket>`, the same origin
as the page. A browser cannot put an `Authorization` header on a WebSocket, and the key must not
travel in a URL (proxies and logs keep URLs), so the key buys a ticket instead:

- random (256 bits), one use, valid `TICKET_TTL_S` seconds; kept in memory only as its SHA-256
  (a dictionary keyed by the hash: nothing to compare byte by byte, nothing usable if dumped);
  never logged (uvicorn's line with the query is masked, backend/logs/redaction.py);
- bound to the key's id: the device is `browser-<key id>` (`browser-admin` for the admin
  token), so one key is one device; a second tab replaces the first, as a stock device that
  reconnects does;
- refused (HTTP answer to the upgrade, nothing accepted) when unknown, reused, expired, or when
  its key was revoked since it was issued; when the `Origin` header names another site (a page
  elsewhere must not ride the user's ticket: cross-site WebSocket hijacking); and with 429 by
  the same per-address and per-device handshake budgets a stock device has.

After the upgrade the socket speaks the stock device protocol (hello, listen, abort, MCP
envelopes as text; binary protocol version 1, i.e. one raw Opus packet or PCM16 frame per binary
message, as the hello's `audio_params.format` says). Its link goes to the bridge's
`LinkAcceptor` like any WebSocket device's, so the session, its MCP client, the voice loop and
the registry are the stock ones. The key's scopes do not follow: the browser is a device like
another, its conversation gets the device rules, not the key's. Bounds are the device
WebSocket's: `max_message_bytes` per message (1009), `write_timeout_s` per write, the session's
inbound limit (junk binary is charged through `on_discarded`, a flood is closed 1008 and its
next handshakes wait).

Two things the page learns beyond the stock protocol (issue #30):

- the ticket's `voice` says whether this bridge hears speech (`{"available": false, "reason":
  ...}` when voice is off or its packages are missing), so the page never streams audio nobody
  hears: it offers typed messages instead, which get text answers;
- each tool call of the device's own turns (the registry's `tool_called` events whose actor is
  `device:<its id>`, its own tools and external MCP servers' alike) goes to its socket as
  `{"type": "tool_call", "tool", "server", "arguments", "outcome", "duration_ms", "error"}`
  once it finished, so the page shows them under the turn. A stock device never gets it.
"""

import asyncio
import contextlib
import hashlib
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Protocol
from urllib.parse import urlsplit

import structlog
from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field
from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketState

from backend.api.errors import errors
from backend.api.scopes import needs
from backend.config import Settings
from backend.errors import MessageTooLarge
from backend.keys import Principal, Scope
from backend.logs import LogBudget, mask_uvicorn_query_tokens
from backend.metrics import record_handshake_refused
from backend.protocol.audio import AudioFrame
from backend.transports.admission import HandshakeLimits
from backend.transports.base import DeviceIdentity, LinkAcceptor, LinkHandler
from backend.transports.errors import LinkClosed

log = structlog.get_logger("transport.browser")

DEVICE_PATH = "/console/device"
TICKET_PATH = "/api/console/talk"
TICKET_TTL_S = 30.0
DEVICE_PREFIX = "browser-"
PROTOCOL_VERSION = 1  # raw Opus (or PCM16) per binary message: what a page can produce cheaply
MAX_TICKETS = 1024  # outstanding in all: issuing more drops the oldest
MAX_TICKETS_PER_KEY = 4  # a page needs one; a few for tabs opened together
GOING_AWAY = 1001
POLICY = 1008
TOO_BIG = 1009
_BROKE_A_BOUND = (POLICY, TOO_BIG)
SHUTDOWN = "bridge shutting down"
# backend.devices.state.EventKind.TOOL_CALLED (a transport does not import the registry).
TOOL_CALLED = "tool_called"
TOOL_CALL = "tool_call"  # the page's message for one finished tool call of its device's turn
DEVICE_ACTOR = "device:"  # the actor of a device's own turn (backend/dialogue/device_chat.py)
EXTERNAL_SERVER = "mcp:"  # the event's device id for an external MCP server's tool

ActiveKey = Callable[[str], Principal | None]
# Why devices get no voice on this bridge (None: they do).
VoiceUnavailable = Callable[[], str | None]


class DeviceEventView(Protocol):
    """What the transport reads of a registry event (`backend.devices.state.DeviceEvent`)."""

    @property
    def kind(self) -> str:
        """The event's name, `tool_called` for a finished or refused tool call."""

    @property
    def device_id(self) -> str:
        """The device, or `mcp:<server>` for an external server's tool."""

    @property
    def detail(self) -> Mapping[str, Any]:
        """tool, outcome, duration_ms, actor, arguments, confirmed, error."""

    @property
    def origin(self) -> str | None:
        """The other bridge instance it happened on; None: this one."""


EventListener = Callable[[DeviceEventView], None]
# `DeviceRegistry.subscribe`: calls the listener on every event, returns the unsubscriber.
Subscribe = Callable[[EventListener], Callable[[], None]]


def device_id_of(key_id: str) -> str:
    """The device a key's browser becomes (a key id is 12 hex digits; the admin's is `admin`)."""
    return f"{DEVICE_PREFIX}{key_id.lower()}"


# ---- tickets -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Ticket:
    key_id: str
    expires_at: float


class TalkTickets:
    """One-use tickets, kept as their SHA-256 hashes, each bound to a key id."""

    def __init__(
        self, ttl_s: float = TICKET_TTL_S, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._by_hash: OrderedDict[str, _Ticket] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._by_hash)

    def issue(self, key_id: str) -> str:
        """A fresh ticket for `key_id`; the key's oldest outstanding ones go past the cap."""
        self._prune()
        mine = [digest for digest, ticket in self._by_hash.items() if ticket.key_id == key_id]
        for digest in mine[: max(0, len(mine) - MAX_TICKETS_PER_KEY + 1)]:
            del self._by_hash[digest]
        while len(self._by_hash) >= MAX_TICKETS:
            self._by_hash.popitem(last=False)
        ticket = secrets.token_urlsafe(32)
        self._by_hash[_digest(ticket)] = _Ticket(key_id, self._clock() + self.ttl_s)
        return ticket

    def redeem(self, ticket: str | None) -> str | None:
        """The key id of a valid ticket, which is used up; None when unknown, used or expired."""
        if not ticket or len(ticket) > 128:
            return None
        found = self._by_hash.pop(_digest(ticket), None)
        if found is None or found.expires_at <= self._clock():
            return None
        return found.key_id

    def _prune(self) -> None:
        now = self._clock()
        while self._by_hash:
            digest, oldest = next(iter(self._by_hash.items()))
            if oldest.expires_at > now:
                return  # issued in order with one lifetime: the rest expire later
            del self._by_hash[digest]


def _digest(ticket: str) -> str:
    return hashlib.sha256(ticket.encode("utf-8", "surrogatepass")).hexdigest()


class TalkVoice(BaseModel):
    """Whether this bridge hears the page's speech and speaks its answers."""

    available: bool
    reason: str | None = Field(
        default=None,
        description="why not (voice turned off, packages missing): the page then offers typed "
        "messages, answered in text",
    )


class TalkTicket(BaseModel):
    """A short-lived, single-use ticket that lets the console page open a device WebSocket."""

    ticket: str
    device_id: str
    path: str
    expires_in_s: float
    voice: TalkVoice


# ---- the link ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkLimits:
    """Per-link limits: the largest message in bytes and the write timeout in seconds."""

    max_message_bytes: int
    write_timeout_s: float


class BrowserLink:
    """A browser's socket as the session sees it: a stock WebSocket device, version 1 framing."""

    __slots__ = ("_limits", "close_sent", "identity", "websocket")
    conversation_scoped = True

    def __init__(self, websocket: WebSocket, identity: DeviceIdentity, limits: LinkLimits) -> None:
        self.websocket = websocket
        self.identity = identity
        self._limits = limits
        self.close_sent: int | None = None

    async def send_text(self, text: str) -> None:
        """Send a JSON message; raises MessageTooLarge past the link's limit."""
        limit = self._limits.max_message_bytes
        if len(text) * 4 > limit and (size := len(text.encode())) > limit:
            raise MessageTooLarge(size, limit)
        await self._send({"type": "websocket.send", "text": text})

    async def send_audio(self, frame: AudioFrame) -> None:
        """Send one audio frame as a binary message; raises MessageTooLarge past the limit."""
        if len(frame.payload) > self._limits.max_message_bytes:
            raise MessageTooLarge(len(frame.payload), self._limits.max_message_bytes)
        await self._send({"type": "websocket.send", "bytes": frame.payload})

    async def _send(self, message: dict[str, Any]) -> None:
        if self.close_sent is not None:
            raise LinkClosed(f"link closed ({self.close_sent})")
        try:
            # uvicorn's send waits while the socket's write buffer is over its high-water mark.
            async with asyncio.timeout(self._limits.write_timeout_s):
                await self.websocket.send(message)
        except TimeoutError:
            # The page stopped reading (a frozen tab): nothing more will fit.
            await self.close(POLICY, "write timed out: the device is not reading")
            raise LinkClosed("write timed out: the device is not reading") from None
        except (OSError, RuntimeError) as exc:  # uvicorn's ClientDisconnected is an OSError
            raise LinkClosed(f"link closed ({type(exc).__name__})") from None

    def hello_fields(self, session_id: str) -> dict[str, str]:
        """The hello reply's transport fields: the page is a stock WebSocket device."""
        # The protocol's value: the page is a stock WebSocket device ("browser" is only the
        # registry's transport name, which says how it got here).
        return {"transport": "websocket"}

    def conversation_ended(self, session_id: str) -> None:
        """Nothing to release: the link is the conversation."""
        pass  # the link is the conversation, as on the device WebSocket

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the WebSocket once; a page that is already gone is not an error."""
        if self.close_sent is not None:
            return
        self.close_sent = code
        if self.websocket.application_state is WebSocketState.CONNECTED:
            with contextlib.suppress(OSError, RuntimeError):  # the page may be gone already
                await self.websocket.close(code, reason[:120])  # a close reason is ≤ 123 bytes


# ---- the transport -----------------------------------------------------------------------------


class Refused(Exception):
    """The upgrade is answered with `status` and `reason` instead of a WebSocket."""

    def __init__(self, status: int, reason: str, kind: str = "other") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.kind = kind  # bridge_handshakes_refused_total's reason


class BrowserTransport:
    """The talk page's devices: tickets, the WebSocket route, links for the acceptor."""

    name = "browser"

    def __init__(
        self,
        settings: Settings,
        active_key: ActiveKey,
        limits: HandshakeLimits | None = None,
        tickets: TalkTickets | None = None,
        *,
        voice_unavailable: VoiceUnavailable | None = None,
        subscribe: Subscribe | None = None,
    ) -> None:
        """`active_key(key_id)` is the key's principal while it is active (None once revoked);
        `limits` are the stock devices' handshake budgets (per address, per device);
        `voice_unavailable()` says why devices get no voice (None: they do; the ticket tells
        the page); `subscribe` is the registry's, for the tool calls of each page's turns."""
        self._settings = settings
        self._active_key = active_key
        self._limits = limits
        self.tickets = tickets or TalkTickets()
        self._voice_unavailable = voice_unavailable or (lambda: None)
        self._subscribe = subscribe
        self._unsubscribe: Callable[[], None] | None = None
        self._link_limits = LinkLimits(settings.max_message_bytes, settings.write_timeout_s)
        self._allowed_origins = frozenset(o.rstrip("/").lower() for o in settings.cors_origins)
        self._acceptor: LinkAcceptor | None = None
        self._links: set[BrowserLink] = set()
        self._by_device: dict[str, BrowserLink] = {}  # the newest link of each browser device
        self._sends: set[asyncio.Task[None]] = set()  # tool call messages on their way
        self._refusals = LogBudget(log, burst=5)  # a refused page may retry fast
        mask_uvicorn_query_tokens()  # uvicorn logs each WebSocket's path with its ?ticket=

    # ---- Transport ----

    async def start(self, acceptor: LinkAcceptor) -> None:
        """Remember the acceptor and follow the registry's tool calls; the routes serve on the
        admin listener, nothing to bind."""
        self._acceptor = acceptor
        if self._subscribe is not None and self._unsubscribe is None:
            self._unsubscribe = self._subscribe(self.on_device_event)

    async def stop(self) -> None:
        """Close every browser link with 1001; later upgrades are refused (503)."""
        self._acceptor = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for task in list(self._sends):
            task.cancel()
        await asyncio.gather(
            *(link.close(GOING_AWAY, SHUTDOWN) for link in list(self._links)),
            *list(self._sends),
            return_exceptions=True,
        )

    def endpoints(self) -> dict[str, str]:
        """No endpoint of its own: it is served on the admin listener."""
        return {}  # on the admin listener, whose URL the bridge reports itself

    @property
    def links(self) -> int:
        """How many browser links are open."""
        return len(self._links)

    # ---- HTTP ----

    @property
    def routes(self) -> list[BaseRoute]:
        """The WebSocket route the console page connects to with its ticket."""
        return [WebSocketRoute(DEVICE_PATH, self.serve)]

    def router(self) -> APIRouter:
        """The API route that issues talk tickets (scope `console:talk`)."""
        router = APIRouter()
        talker = Annotated[Principal, Depends(needs(Scope.CONSOLE_TALK))]

        @router.post(TICKET_PATH, responses=errors(403))
        async def talk_ticket(principal: talker) -> TalkTicket:
            """A one-use ticket for `/console/device` (30 s): the browser becomes the device
            `browser-<key id>`; `voice` says whether this bridge hears it speak."""
            tickets = self.tickets
            reason = self._voice_unavailable()
            return TalkTicket(
                ticket=tickets.issue(principal.key_id),
                device_id=device_id_of(principal.key_id),
                path=DEVICE_PATH,
                expires_in_s=tickets.ttl_s,
                voice=TalkVoice(available=reason is None, reason=reason),
            )

        return router

    # ---- WebSocket ----

    async def serve(self, websocket: WebSocket) -> None:
        """One browser device, from the upgrade to the close."""
        remote = _remote(websocket)
        try:
            identity = self._admit(websocket, remote)
        except Refused as refused:
            record_handshake_refused(self.name, refused.kind)
            self._refusals.warning(
                f"talk handshake refused ({refused.status})", reason=refused.reason, remote=remote
            )
            body = PlainTextResponse(f"{refused.reason}\n", status_code=refused.status)
            await websocket.send_denial_response(body)
            return
        acceptor = self._acceptor
        if acceptor is None:  # stopped while admitting
            await websocket.send_denial_response(PlainTextResponse(SHUTDOWN, status_code=503))
            return
        await websocket.accept()
        link = BrowserLink(websocket, identity, self._link_limits)
        self._links.add(link)
        try:
            handler = acceptor.open_link(link)
        except Exception:
            self._links.discard(link)
            await link.close(1011, "internal error")
            raise
        self._by_device[identity.device_id] = link  # a second tab replaces the first
        reason = "connection lost (1006)"
        try:
            reason = await self._pump(websocket, link, handler)
        finally:
            self._links.discard(link)
            if self._by_device.get(identity.device_id) is link:
                del self._by_device[identity.device_id]
            if link.close_sent in _BROKE_A_BOUND and self._limits is not None:
                self._limits.penalize(identity.device_id)
            handler.on_closed(reason)

    def _admit(self, websocket: WebSocket, remote: str | None) -> DeviceIdentity:
        """The device this upgrade becomes, or Refused. The ticket is spent only once the
        origin and the address budget passed: a refused page keeps no used-up ticket."""
        if self._acceptor is None:
            raise Refused(503, SHUTDOWN, "unavailable")
        if not self._same_origin(websocket.headers):
            raise Refused(403, "cross-origin WebSocket refused", "origin")
        limits = self._limits
        if limits is not None and (refusal := limits.ip_refusal(remote)) is not None:
            raise Refused(429, refusal, "address_rate")
        key_id = self.tickets.redeem(websocket.query_params.get("ticket"))
        if key_id is None:
            raise Refused(401, "unknown, used or expired ticket", "ticket")
        if key_id != "admin" and self._active_key(key_id) is None:
            raise Refused(401, "the ticket's key was revoked", "ticket")
        device_id = device_id_of(key_id)
        if limits is not None and (refusal := limits.device_refusal(device_id)) is not None:
            raise Refused(429, refusal, "device_rate")
        return DeviceIdentity(
            device_id=device_id,
            client_id=None,
            protocol_version=PROTOCOL_VERSION,
            transport=self.name,
            remote=remote,
        )

    def _same_origin(self, headers: Mapping[str, str]) -> bool:
        """No Origin (not a browser), or the page's own host, or a configured CORS origin."""
        origin = headers.get("origin")
        if origin is None:
            return True
        origin = origin.strip().rstrip("/").lower()
        if origin in self._allowed_origins:
            return True
        parts = urlsplit(origin)
        host = (headers.get("host") or "").strip().lower()
        return parts.scheme in ("http", "https") and bool(host) and parts.netloc == host

    async def _pump(self, websocket: WebSocket, link: BrowserLink, handler: LinkHandler) -> str:
        """Every message to the handler until the socket ends; returns why it ended."""
        limit = self._link_limits.max_message_bytes
        drops: LogBudget | None = None
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return _close_reason(link, message)
                text, data = message.get("text"), message.get("bytes")
                size = len(data) if data is not None else len(text or "")
                if size > limit or (text is not None and len(text.encode()) > limit):
                    await link.close(TOO_BIG, f"message larger than {limit} bytes")
                    continue  # the disconnect follows
                if text is not None:
                    await handler.on_text(text)
                elif data:
                    # Version 1: the message is the packet; the voice loop drops what does
                    # not decode and the session's inbound limit charges every byte.
                    handler.on_audio(AudioFrame(data))
                else:  # an empty binary message is no audio, but still costs a frame
                    handler.on_discarded(0)
                    if drops is None:
                        drops = LogBudget(log.bind(device_id=link.identity.device_id))
                    drops.warning("dropped empty audio frame")
        except (OSError, RuntimeError, LinkClosed):
            return "connection lost (1006)"
        finally:
            if drops is not None:
                drops.close()

    # ---- tool calls of the pages' turns ----

    def on_device_event(self, event: DeviceEventView) -> None:
        """The registry's listener: a finished tool call of a browser device's own turn goes to
        that page (O(1) for every other event; nothing is awaited here)."""
        if event.kind != TOOL_CALLED or event.origin is not None:
            return
        actor = event.detail.get("actor")
        if not isinstance(actor, str) or not actor.startswith(DEVICE_ACTOR + DEVICE_PREFIX):
            return
        link = self._by_device.get(actor.removeprefix(DEVICE_ACTOR))
        if link is None or link.close_sent is not None:
            return
        text = tool_call_text(event, self._link_limits.max_message_bytes)
        try:
            task = asyncio.get_running_loop().create_task(_send_quietly(link, text))
        except RuntimeError:  # no loop (a test emitting by hand): nobody to tell
            return
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)


def tool_call_text(event: DeviceEventView, limit: int) -> str:
    """The page's `tool_call` message for a `tool_called` event; the arguments become null
    when they would make it larger than `limit` bytes."""
    detail = event.detail
    device_id = event.device_id
    message: dict[str, Any] = {
        "type": TOOL_CALL,
        "tool": str(detail.get("tool") or ""),
        "server": device_id.removeprefix(EXTERNAL_SERVER)
        if device_id.startswith(EXTERNAL_SERVER)
        else None,
        "arguments": detail.get("arguments"),
        "outcome": detail.get("outcome"),
        "duration_ms": detail.get("duration_ms"),
        "error": detail.get("error"),
    }
    text = _json(message)
    if len(text.encode()) > limit:
        message["arguments"] = None
        message["tool"] = message["tool"][:256]
        text = _json(message)
    return text


def _json(message: dict[str, Any]) -> str:
    return json.dumps(message, ensure_ascii=False, separators=(",", ":"), default=str)


async def _send_quietly(link: BrowserLink, text: str) -> None:
    with contextlib.suppress(LinkClosed, MessageTooLarge):  # the page left: nothing to show
        await link.send_text(text)


def _close_reason(link: BrowserLink, message: Mapping[str, Any]) -> str:
    code = link.close_sent or message.get("code") or 1005
    reason = message.get("reason") or ""
    return f"closed ({code}): {reason}" if reason else f"closed ({code})"


def _remote(websocket: WebSocket) -> str | None:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else None
