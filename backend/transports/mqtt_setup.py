"""The MQTT + UDP transport as the bridge runs it, built from `Settings` (docs/mqtt.md).

`MqttService` is one `Transport` for the bridge: with `mqtt_url = "embedded"` devices connect to
the bridge's own MQTT endpoint (`mqtt_endpoint`: no broker, every connection is one device's
link); with `mqtt[s]://…` the bridge is a client of an external broker (`mqtt.MqttTransport`).
Either way devices log in with username = device key and the password that `DerivedCredentials`
derives from the bridge's credential secret (`mqtt_secret`, else the file `mqtt.secret` in the
data directory, created once with mode 0600 like the tokens). `esp32-bridge mqtt credentials`
prints what one device needs and the broker files an external broker needs.
"""

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import structlog

from backend.common import WILDCARD_HOSTS, reachable_host, url_host
from backend.config import Settings
from backend.transports.admission import Admission, HandshakeLimits
from backend.transports.base import LinkAcceptor
from backend.transports.errors import MqttConfigError
from backend.transports.mqtt import BrokerAddress, BrokerVouched, MqttSettings, MqttTransport
from backend.transports.mqtt_credentials import (
    CredentialProvider,
    DerivedCredentials,
    EitherCredentials,
)
from backend.transports.mqtt_endpoint import DeviceLogin, EndpointSettings, MqttEndpoint
from backend.transports.throttle import (
    ConnectionGuard,
)
from backend.transports.udp import UdpAudioChannel

log = structlog.get_logger("transport.mqtt")

EMBEDDED = "embedded"
MQTT_SECRET_FILE = "mqtt.secret"


def mqtt_enabled(settings: Settings) -> bool:
    """Whether an MQTT transport is configured (`mqtt_url` set)."""
    return bool(settings.mqtt_url)


def mqtt_secret(settings: Settings, created: list[Path] | None = None) -> bytes:
    """The credential secret: the setting, else the data-dir file (created when missing)."""
    if settings.mqtt_secret is not None and settings.mqtt_secret.get_secret_value():
        return settings.mqtt_secret.get_secret_value().encode()
    path = settings.data_dir / MQTT_SECRET_FILE
    existing = _read(path)
    if existing:
        return existing.encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(32)
    try:  # O_EXCL + 0600: never readable by others, never clobbers a concurrent writer's secret
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return (_read(path) or value).encode()
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    if created is not None:
        created.append(path)
    return value.encode()


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def device_credentials(settings: Settings, created: list[Path] | None = None) -> DerivedCredentials:
    """The derived MQTT credentials, keyed by `mqtt_secret` (see there)."""
    return DerivedCredentials(mqtt_secret(settings, created))


def check_mqtt_settings(settings: Settings) -> BrokerAddress | None:
    """The MQTT settings' own mistakes, as MqttConfigError, before anything is bound or written;
    the broker's address (None for the embedded endpoint)."""
    if not settings.udp_public_host and settings.udp_host in WILDCARD_HOSTS:
        raise MqttConfigError(
            "udp_public_host must be set when udp_host binds every interface: it is the "
            "address devices send audio to (--udp-public-host or BRIDGE_UDP_PUBLIC_HOST)"
        )
    if not settings.mqtt_url or settings.mqtt_url == EMBEDDED:
        return None
    return BrokerAddress.parse(settings.mqtt_url)  # MqttConfigError for a bad URL


class MqttService:
    """The `Transport` the bridge starts: the embedded endpoint, or a client of a broker."""

    name = "mqtt"

    def __init__(
        self,
        settings: Settings,
        created: list[Path] | None = None,
        device_logins: CredentialProvider | None = None,
        handshake_limits: HandshakeLimits | None = None,
    ) -> None:
        """`handshake_limits`: the per-device handshake budget a WebSocket device has too, so a
        device cut off (1008) waits before it comes back."""
        url = settings.mqtt_url
        self._handshake_limits = handshake_limits
        if not url:
            raise MqttConfigError("MQTT is off (mqtt_url is not set)")
        self.settings = settings
        self.credentials = device_credentials(settings, created)
        # Who may log in to the embedded endpoint: each device with its own token (provisioning),
        # and with the derived development passwords only when device auth is not per device.
        providers: list[CredentialProvider] = [] if device_logins is None else [device_logins]
        if settings.device_auth != "device" or device_logins is None:
            providers.append(self.credentials)
        self._logins = EitherCredentials(*providers)
        self.embedded = url == EMBEDDED
        self._address = check_mqtt_settings(settings)
        self.endpoint: MqttEndpoint | None = None
        self.transport: MqttTransport | None = None
        self._shards: frozenset[int] | None = None  # what set_shards asked for before start

    def _transport_settings(self, broker_url: str) -> MqttSettings:
        settings = self.settings
        return MqttSettings(
            broker_url=broker_url,
            client_id=settings.mqtt_client_id,
            topic_prefix=settings.mqtt_topic_prefix,
            shards=settings.mqtt_shards,
            keepalive_s=settings.mqtt_keepalive_s,
            udp_host=settings.udp_host,
            udp_port=settings.udp_port,
            udp_public_host=settings.udp_public_host,
            silence_timeout_s=settings.mqtt_silence_timeout_s,
            tls_ca_file=str(settings.mqtt_ca_file) if settings.mqtt_ca_file else None,
            max_message_bytes=settings.max_message_bytes,
        )

    def _endpoint(self) -> MqttEndpoint:
        settings = self.settings
        return MqttEndpoint(
            EndpointSettings(
                host=settings.mqtt_host,
                port=settings.mqtt_port,
                topic_prefix=settings.mqtt_topic_prefix,
                max_message_bytes=settings.max_message_bytes,
                write_timeout_s=settings.write_timeout_s,
                idle_timeout_s=settings.mqtt_silence_timeout_s,
                udp_public_host=self._udp_public_host(),
            ),
            Admission(DeviceLogin(self._logins), self._handshake_limits),
            ConnectionGuard.for_listener(settings, log, transport="mqtt"),
            udp=UdpAudioChannel(settings.udp_host, settings.udp_port),
        )

    def _udp_public_host(self) -> str:
        return self.settings.udp_public_host or self.settings.udp_host

    async def start(self, acceptor: LinkAcceptor) -> None:
        """Start the endpoint, or the client of the external broker; on failure undo it."""
        try:
            if self.embedded:
                self.endpoint = self._endpoint()
                await self.endpoint.start(acceptor)
                return
            self.transport = MqttTransport(
                self._transport_settings(self.settings.mqtt_url or ""),
                Admission(BrokerVouched(), self._handshake_limits),
            )
            await self.transport.set_shards(self._shards)
            await self.transport.start(acceptor)
        except BaseException:
            await self.stop()
            raise

    async def set_shards(self, shards: Iterable[int] | None) -> None:
        """The shards this instance serves (None: all), before or after `start`: see
        `MqttTransport.set_shards`. MqttConfigError with the embedded endpoint, whose topics
        have no shards, and for a shard outside 0..mqtt_shards-1."""
        if self.embedded:
            raise MqttConfigError("the embedded MQTT endpoint has no shards")
        owned = None if shards is None else frozenset(shards)
        if self.transport is not None:
            await self.transport.set_shards(owned)
        else:
            for shard in owned or ():
                if not 0 <= shard < self.settings.mqtt_shards:
                    raise MqttConfigError(
                        f"shard {shard} is not in 0..{self.settings.mqtt_shards - 1}"
                    )
        self._shards = owned

    @property
    def owned_shards(self) -> frozenset[int] | None:
        """The shards this instance serves (None: all)."""
        return self._shards

    async def stop(self) -> None:
        """Stop whichever MQTT side is running."""
        if self.transport is not None:
            await self.transport.stop()
        if self.endpoint is not None:
            await self.endpoint.stop()

    @property
    def udp(self) -> UdpAudioChannel | None:
        """The UDP audio channel of the running MQTT side, if any."""
        running = self.endpoint or self.transport
        return None if running is None else running.udp

    @property
    def device_url(self) -> str:
        """Where devices reach MQTT (no credentials): `mqtt://host:port`."""
        if self.endpoint is not None:
            host = self.settings.mqtt_host
            if host in WILDCARD_HOSTS and self.settings.udp_public_host:
                host = self.settings.udp_public_host
            return f"mqtt://{url_host(reachable_host(host))}:{self.endpoint.port}"
        if self.embedded:
            return f"mqtt://{url_host(reachable_host(self.settings.mqtt_host))}:{self.settings.mqtt_port}"
        address = self._address
        assert address is not None
        scheme = "mqtts" if address.tls else "mqtt"
        return f"{scheme}://{url_host(address.host)}:{address.port}"

    def device_endpoint(self, hostname: str) -> str:
        """`host:port` of MQTT for the OTA answer of a device that reached the bridge at
        `hostname`: that host with the embedded endpoint's port, else the external broker's."""
        if self.endpoint is not None:
            return f"{url_host(hostname)}:{self.endpoint.port}"
        return self.device_url.split("://", 1)[1]

    def endpoints(self) -> dict[str, str]:
        """What the bridge reports for MQTT: device URL, broker kind, topic prefix, UDP address."""
        found = {
            "mqtt": self.device_url,
            "mqtt_broker": EMBEDDED if self.embedded else "external",
            "mqtt_topic_prefix": self.settings.mqtt_topic_prefix,
        }
        if self.settings.mqtt_shards > 1:
            found["mqtt_shards"] = str(self.settings.mqtt_shards)
        running = self.endpoint or self.transport
        if running is not None:
            found["udp"] = running.endpoints()["udp"]
        return found
