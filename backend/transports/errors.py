"""The errors of the transports: refused handshakes, closed links, malformed datagrams, topics
and broker settings. All are `BridgeError`s."""

from typing import TYPE_CHECKING

from backend.errors import BridgeError

if TYPE_CHECKING:
    from backend.transports.udp_packet import DropReason


class PacketError(BridgeError, ValueError):
    """A datagram that is not a well-formed packet; `reason` says which rule it broke."""

    def __init__(self, reason: "DropReason", detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class UdpError(BridgeError):
    """The UDP channel cannot do what was asked (not started, bad parameters)."""


class TopicError(BridgeError):
    """A topic, prefix, device key or client id that the scheme does not accept."""


class WrongShard(TopicError):
    """A well-formed device topic whose shard level is not its device key's shard."""


class CredentialError(BridgeError):
    """Credentials cannot be issued or written (bad name, tool missing or failing)."""


class MqttConfigError(BridgeError):
    """The MQTT settings cannot work (bad broker URL, no public UDP address)."""


class LinkClosed(BridgeError):
    """Sending on a link that is already closed."""


class HandshakeRefused(BridgeError):
    """A device was refused at the handshake; `status` is the HTTP status a WebSocket answers."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
