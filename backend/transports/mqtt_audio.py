"""The UDP audio of one MQTT device link: one `UdpSession` per conversation, opened by the hello.

Shared by both MQTT links (the bridge's own endpoint and the client of an external broker), so
the rules live once: a hello replaces the previous session, `conversation_ended` releases the
one it names, and uplink audio reaches the handler only while the link is open.
"""

from collections.abc import Callable

from backend.protocol.audio import AudioFrame
from backend.transports.errors import LinkClosed, UdpError
from backend.transports.udp import UdpAudioChannel, UdpSession


class LinkAudio:
    """The UDP session of one MQTT link's current conversation, if any."""

    __slots__ = ("_channel", "_device_id", "_on_audio", "_public_host", "session")

    def __init__(
        self,
        channel: UdpAudioChannel,
        public_host: str,
        device_id: str,
        on_audio: Callable[[AudioFrame], None],
    ) -> None:
        self._channel = channel
        self._public_host = public_host
        self._device_id = device_id
        self._on_audio = on_audio
        self.session: UdpSession | None = None

    def open(self, session_id: str) -> dict[str, object]:
        """A fresh UDP session (replacing any earlier one), as the hello's transport fields."""
        self.release()
        self.session = self._channel.open_session(self._device_id, session_id, self._on_audio)
        block = self.session.hello_block(self._public_host, self._channel.port)
        return {"transport": "udp", "udp": block}

    def send(self, frame: AudioFrame) -> bool:
        """Send one frame on the current session; False when there is none (no hello yet)."""
        session = self.session
        if session is None:
            return False
        try:
            self._channel.send(session, frame)
        except UdpError as exc:
            raise LinkClosed(str(exc)) from None
        return True

    def ended(self, session_id: str) -> None:
        """The conversation `session_id` ended: release its UDP session (a stale id is ignored)."""
        session = self.session
        if session is not None and session.session_id == session_id:
            self.release()

    def release(self) -> None:
        """Close the current UDP session, if any."""
        if self.session is not None:
            self._channel.close_session(self.session)
            self.session = None
