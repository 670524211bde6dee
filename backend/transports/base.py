"""The seam between transports (WebSocket, MQTT+UDP) and the transport-neutral device session.

A transport owns bytes, frames and envelopes. For every device connection that passed
`backend.transports.admission` it builds a `DeviceLink` and asks the bridge's `LinkAcceptor` for
the `LinkHandler` that receives everything the device sends. A transport knows nothing of MCP,
tools or the registry; the session knows nothing of sockets, topics or datagrams.

Audio crosses the seam as `AudioFrame`s (one Opus packet each): the transport does the framing,
the binary protocol versions 1-3 on WebSocket, the encrypted datagrams on UDP.
"""

from dataclasses import dataclass
from typing import Any, Protocol

from backend.protocol.audio import AudioFrame


@dataclass(frozen=True, slots=True)
class DeviceIdentity:
    """Who is on the other end, as established by the transport handshake (see admission)."""

    device_id: str
    client_id: str | None
    protocol_version: int
    transport: str
    remote: str | None = None


class DeviceLink(Protocol):
    """One live connection to one device, as the session sees it."""

    @property
    def identity(self) -> DeviceIdentity:
        """Who the device said it is in its handshake (ids, protocol version)."""

    @property
    def conversation_scoped(self) -> bool:
        """True when the link lives only for one conversation (stock WebSocket: it is opened
        for a conversation and dropped after); False for a link that stays up while the device
        is idle (MQTT), where MCP runs before and without any hello."""
        ...

    async def send_text(self, text: str) -> None:
        """Send one JSON text message; raises LinkClosed when the link is gone."""
        ...

    async def send_audio(self, frame: AudioFrame) -> None:
        """Send one Opus packet in this link's framing; raises LinkClosed when it is gone."""
        ...

    def hello_fields(self, session_id: str) -> dict[str, Any]:
        """The transport's part of the server hello (`transport`, and `udp` for MQTT+UDP)."""
        ...

    def conversation_ended(self, session_id: str) -> None:
        """Release what the transport holds for one conversation (UDP keys); idempotent."""
        ...

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Close the link (WebSocket close codes; other transports map them)."""
        ...


class LinkHandler(Protocol):
    """What a transport calls for one link, in order: texts and audio, then `on_closed` once."""

    async def on_text(self, text: str) -> None:
        """One JSON text message from the device (any content: the handler parses it)."""
        ...

    def on_audio(self, frame: AudioFrame) -> None:
        """One decoded uplink audio packet (hot path: must not block)."""
        ...

    def on_discarded(self, size: int) -> None:
        """A frame of `size` bytes the transport dropped (undecodable audio, a message it could
        not deliver): it still costs the device its inbound limit, so junk cannot flood past
        the bound valid traffic is held to. May close the link."""
        ...

    def on_closed(self, reason: str) -> None:
        """The link is gone (closed by either side, dropped, or replaced); called exactly once."""
        ...


class LinkAcceptor(Protocol):
    """The bridge side of the seam: hands every new link to a session."""

    def open_link(self, link: DeviceLink) -> LinkHandler:
        """Take over a new admitted link; the handler returned receives what it carries."""


class Transport(Protocol):
    """A device-facing transport, started and stopped by the bridge with the others."""

    name: str

    async def start(self, acceptor: LinkAcceptor) -> None:
        """Start accepting devices; every admitted link goes to `acceptor.open_link`."""
        ...

    async def stop(self) -> None:
        """Stop accepting and close every link (code 1001, going away)."""
        ...

    def endpoints(self) -> dict[str, str]:
        """Where devices reach this transport once started, e.g. {"websocket": "ws://..."}."""
        ...
