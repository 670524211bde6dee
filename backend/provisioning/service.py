"""`Provisioning`: what the bridge wires in for the OTA endpoint and per-device credentials.

It owns the `ProvisioningStore` (credentials, activations), the `FirmwareReleases`, the request
rate limits and the device-facing HTTP listener (`backend.provisioning.http`), and it is where
the two sides meet: devices ask (`ota`, `activate`), the operator decides (`approve`,
`revoke`, enrollment codes, serial keys), and the registry hears about both (a device's system
info goes into the catalogue through `DeviceRegistry.reported`; a revoked device's live link is
closed through `DeviceRegistry.disconnect`).

The OTA answer for a device (protocol reference §5.2):

- approved, with the Client-Id it was approved with: `server_time`, `firmware` (an upgrade only
  when one is published for its board and newer), and its own `websocket` {url, token,
  version} or `mqtt` {..., publish_topic};
- a usable enrollment code in the URL, or a MAC prefix of `activation_auto_approve_macs` (and
  not approved for another Client-Id): approved at once, then as above;
- anyone else: `server_time`, `firmware` (no upgrade), `activation` {code, message,
  challenge}, and no credentials.

`device_auth = "shared"` (development) hands every device the shared token without activation;
`"off"` hands out no token at all.

The listener also serves the bridge's vision endpoint (`backend.vision`, docs/vision.md); each
device learns its URL and its own token in MCP `initialize` (`vision_capability`), the URL built
from the host the device last reached the OTA endpoint at.
"""

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import uvicorn

from backend.auth import DEVICE_TOKEN_FILE, load_or_create_secret, read_token
from backend.common import Lru, reachable_host, url_host
from backend.config import Settings
from backend.devices.registry import DeviceRegistry
from backend.errors import listen_errors
from backend.logs import LogBudget
from backend.metrics import record_approval
from backend.provisioning import ota as proto
from backend.provisioning.errors import TooManyPending
from backend.provisioning.listener import DeviceHttpProtocol
from backend.provisioning.ratelimit import (
    HandshakeLimiter,
    Limits,
    device_key,
    host_of,
)
from backend.provisioning.records import Enrollment, PendingActivation, Provisioned, Transport
from backend.provisioning.releases import (
    FIRMWARE_DIR,
    FIRMWARE_MIGRATIONS,
    FirmwareReleases,
    Release,
)
from backend.provisioning.store import REVOKED, ProvisioningStore
from backend.provisioning.tables import PROVISIONING_MIGRATIONS
from backend.provisioning.tokens import SECRET_FILE
from backend.storage import Database, Migration
from backend.transports.admission import normalize_device_id
from backend.transports.errors import HandshakeRefused, TopicError
from backend.transports.throttle import ConnectionGuard, handshake_cap
from backend.vision.service import VISION_PATH, UploadAudit, VisionService

log = structlog.get_logger("provisioning")

MIGRATIONS: tuple[Migration, ...] = (*PROVISIONING_MIGRATIONS, *FIRMWARE_MIGRATIONS)
LISTEN_BACKLOG = 1024  # the device HTTP listener's kernel queue
REQUEST_HEAD_S = 10.0  # a device-side HTTP connection must start each request within this
_HOSTNAME = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]{1,253})$")
MAX_REMEMBERED_HOSTS = 10_000  # the OTA Host of this many devices, for their vision URL


@dataclass(frozen=True, slots=True)
class Answer:
    """An HTTP answer to a device: status, JSON body, extra headers."""

    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def refusal(status: int, message: str, **headers: str) -> Answer:
    """An error answer: `{"error": message}` with this status and headers."""
    return Answer(status, {"error": message}, dict(headers))


OtaHeadersOrAnswer = proto.OtaHeaders | Answer


class Provisioning:
    """The provisioning side of the bridge (see the module docstring for what it owns)."""

    def __init__(
        self,
        settings: Settings,
        database: Database,
        registry: DeviceRegistry,
        *,
        websocket_port: Callable[[], int],
        mqtt_endpoint: Callable[[str], str | None] = lambda _hostname: None,
        created: list[Path] | None = None,
        clock: Callable[[], float] = time.monotonic,
        audit: UploadAudit | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self._database_path = database.path
        self._websocket_port = websocket_port
        self._mqtt_endpoint = mqtt_endpoint
        secret = credential_secret(settings, created or [])
        self.store = ProvisioningStore(
            database,
            secret.encode(),
            max_pending=settings.max_pending_activations,
            pending_ttl_s=settings.activation_ttl_s,
            require_hmac=settings.activation_require_hmac,
            exempt=settings.rate_limit_exempt,
            on_lost=self._credentials_lost,
        )
        self.releases = FirmwareReleases(
            database, settings.data_dir / FIRMWARE_DIR, max_attempts=settings.firmware_max_attempts
        )
        self.limits = Limits(settings.rate_limits, settings.rate_limit_exempt, clock=clock)
        self.handshake_limits = HandshakeLimiter(self.limits)
        self._auto_macs = tuple(p.strip().lower() for p in settings.activation_auto_approve_macs)
        self._server: _Listener | None = None
        self._server_task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self._mqtt_warned = False
        # Refusals a stranger can cause at line rate: a few are logged, then one count a minute.
        self._refusals = LogBudget(log, burst=5, interval_s=60.0)
        self.vision = VisionService(settings, secret.encode(), self.store, audit=audit, clock=clock)
        # The listener's connections, put to the WebSocket and MQTT listeners' guard at accept
        # (per-address rate and share, penalty box). Its global cap is a backstop at twice
        # `device_http_max_connections`: up to that, uvicorn answers a tiny 503.
        self.connections = ConnectionGuard.for_listener(settings, log, transport="device_http")
        self.connections.limit = handshake_cap(2 * settings.device_http_max_connections)
        self._device_hosts: Lru[str, str] = Lru(MAX_REMEMBERED_HOSTS)

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Needs the open database: load credentials, activations and releases. The database
        holds serial keys and token hashes, so it is made readable by its owner only."""
        if self._database_path is not None:  # None: PostgreSQL, no file of ours
            _owner_only(self._database_path)
        await self.store.load()
        await self.releases.load()
        self.store.start()

    async def stop(self) -> None:
        """Write what is pending (before the database closes)."""
        await self.store.stop()

    async def start_listener(self) -> None:
        """The device-facing HTTP listener (OTA, activation, firmware downloads)."""
        from backend.provisioning.http import device_app

        settings = self.settings
        host, port = settings.device_http_host, settings.device_http_port
        with listen_errors("device HTTP (OTA)", host, port, "device_http"):
            self._socket = _bind(host, port)
        config = uvicorn.Config(
            device_app(self),
            log_config=None,
            access_log=False,
            lifespan="off",
            limit_concurrency=settings.device_http_max_connections,
            timeout_keep_alive=5,
            http=DeviceHttpProtocol.bound(self.connections, REQUEST_HEAD_S),
            # At most 64 accepts per loop wakeup, as on the WebSocket and MQTT listeners: a
            # connection storm cannot hold the loop (the kernel queue is set again below).
            backlog=64,
        )
        self._server = _Listener(config)
        self._server_task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._server_task.done():
                await self._server_task
                raise RuntimeError("device HTTP listener stopped during startup")
            await asyncio.sleep(0.01)
        self._socket.listen(LISTEN_BACKLOG)  # uvicorn's listen(64) shortened the kernel queue

    async def stop_listener(self) -> None:
        """Stop the device-facing HTTP listener and close the vision client."""
        if self._server is not None and self._server_task is not None:
            self._server.should_exit = True
            await self._server_task
            self._server = None
        await self.vision.aclose()

    @property
    def http_port(self) -> int:
        """The bound port of the device-facing listener (the real one when configured as 0)."""
        assert self._socket is not None, "listener not started"
        port: int = self._socket.getsockname()[1]
        return port

    @property
    def ota_url(self) -> str:
        """The OTA URL devices are configured with (a wildcard bind is given as loopback)."""
        host = url_host(reachable_host(self.settings.device_http_host))
        return f"http://{host}:{self.http_port}{self.settings.ota_path}"

    def vision_capability(self, device_id: str) -> dict[str, str] | None:
        """`capabilities.vision` of the device's MCP initialize: the external `vision_url` (and
        its one `vision_token`) when set, else this listener's endpoint and the device's own
        token (None before the listener is up)."""
        settings = self.settings
        if settings.vision_url:
            vision = {"url": settings.vision_url}
            if settings.vision_token is not None:
                vision["token"] = settings.vision_token.get_secret_value()
            return vision
        if self._socket is None:
            return None
        host = self._device_hosts.get(device_id) or self._hostname(None)
        return {
            "url": f"http://{host}:{self.http_port}{VISION_PATH}",
            "token": self.vision.token_for(device_id),
        }

    def enrollment_url(self, code: str) -> str:
        """The OTA URL that enrols a device with `code` (set it as the device's OTA URL)."""
        return f"{self.ota_url}enroll/{code}/"

    # ---- what devices ask ------------------------------------------------------------------------

    def identify(self, kind: str, raw: dict[str, str | None]) -> OtaHeadersOrAnswer:
        """The request's headers, checked and limited per address: OtaHeaders, or the refusal.
        The per-device budget is charged later (`_device_limited`), once the Client-Id is
        checked."""
        ip = host_of(raw.get("remote"))
        limited = self.limits.ip_refusal(kind, ip)
        if limited is not None:
            return refusal(429, limited, **{"Retry-After": "10"})
        try:
            device_id = normalize_device_id(raw.get("device_id"))
        except HandshakeRefused as refused:
            return refusal(400, refused.reason)
        client_id = (raw.get("client_id") or "").strip()
        if not client_id or len(client_id) > 128 or not client_id.isprintable():
            return refusal(400, "missing or malformed Client-Id header")
        serial = (raw.get("serial_number") or "").strip() or None
        if serial is not None and (len(serial) > 64 or not serial.isprintable()):
            return refusal(400, "malformed Serial-Number header")
        return proto.OtaHeaders(
            device_id=device_id,
            client_id=client_id,
            activation_version=raw.get("activation_version"),
            serial_number=serial,
            user_agent=raw.get("user_agent"),
            accept_language=raw.get("accept_language"),
            remote=ip,
        )

    async def ota(
        self,
        headers: proto.OtaHeaders,
        body: dict[str, Any],
        *,
        enrollment: str | None,
        host: str | None,
    ) -> Answer:
        """The answer to an OTA check (POST <ota_path>) of a device."""
        mode = self.settings.device_auth
        device = (
            await self.store.lookup_approved(headers.device_id, headers.client_id)
            if mode == "device"
            else None
        )
        checked = mode != "device" or device is not None
        limited = self._device_limited("ota", headers, checked=checked)
        if limited is not None:
            return limited
        info = proto.summarize(body, headers)
        answer: dict[str, Any] = {
            "server_time": proto.server_time(self.settings.ota_timezone_offset_min)
        }
        if mode != "device":
            self.registry.reported(headers.device_id, headers.client_id, info)
            self._remember_host(headers.device_id, host)
            self._add_firmware(answer, headers.device_id, info, host)
            token = "" if mode == "off" or self._shared_token is None else self._shared_token
            answer["websocket"] = proto.websocket_section(self._websocket_url(host), token)
            return Answer(200, answer)
        if device is None:
            device = await self._auto_approve(headers, info, enrollment)
        if device is None:
            return await self._pending_answer(headers, info, answer)
        self.registry.reported(headers.device_id, headers.client_id, info)
        self._remember_host(headers.device_id, host)  # only the approved device's own Host
        token = await self.store.deliver(device)
        self._add_firmware(answer, headers.device_id, info, host)
        answer.update(self._credentials(device, headers, token, host))
        log.debug("ota check answered", device_id=headers.device_id, board=info.get("board_type"))
        return Answer(200, answer)

    async def _pending_answer(
        self, headers: proto.OtaHeaders, info: dict[str, Any], answer: dict[str, Any]
    ) -> Answer:
        """An activation code for a device nobody approved (503 past its address's share)."""
        try:
            request = await self.store.request_activation(
                headers.device_id,
                headers.client_id,
                serial_number=headers.serial_number,
                remote=headers.remote,
                info={k: v for k, v in info.items() if k != "system_info"},
            )
        except TooManyPending as exc:
            self._refusals.warning(
                "activation refused",
                device_id=headers.device_id,
                reason=str(exc),
                remote=headers.remote,
            )
            return refusal(503, str(exc), **{"Retry-After": "60"})
        section = proto.no_upgrade(info.get("firmware_version"))
        if section is not None:
            answer["firmware"] = section
        answer["activation"] = self._activation(request)
        return Answer(200, answer)

    async def activate(self, headers: proto.OtaHeaders, body: dict[str, Any]) -> Answer:
        """POST <ota_path>activate: 200 approved, 202 pending, 403 a wrong HMAC, 404 nothing
        pending (the device checks for updates again and gets a code)."""
        mode = self.settings.device_auth
        approved = mode == "device" and (
            await self.store.lookup_approved(headers.device_id, headers.client_id) is not None
        )
        limited = self._device_limited("activate", headers, checked=mode != "device" or approved)
        if limited is not None:
            return limited
        if mode != "device" or approved:
            return Answer(200, {"status": "activated"})
        request = await self.store.find_pending(headers.device_id, headers.client_id)
        if request is None:
            return refusal(404, "no pending activation: check for updates again")
        self.store.seen(request)
        checked = self.store.check_hmac(request, body)
        if checked == "invalid":
            self._refusals.warning(
                "activation with a wrong HMAC or challenge",
                device_id=headers.device_id,
                remote=headers.remote,
            )
            return refusal(403, "the HMAC does not match the challenge")
        return Answer(202, {"status": "pending", "code": request.code})

    def download(self, board: str, version: str, remote: str | None) -> Release | Answer:
        """The published release to send (counted), or a refusal."""
        limited = self.limits.ip_refusal("ota", host_of(remote))
        if limited is not None:
            return refusal(429, limited, **{"Retry-After": "10"})
        for release in self.releases.releases():
            if release.board == board and release.version == version:
                self.releases.downloaded(release)
                return release
        return refusal(404, "no such firmware")

    # ---- what the operator decides ---------------------------------------------------------------

    async def approve(
        self, target: str, *, by: str, transport: Transport | None = None
    ) -> Provisioned:
        """Approve a pending activation by its code (or the only one of a device id)."""
        await self.store.sync()  # a request first seen by another instance
        pending = {p.code: p for p in self.store.pending()}
        request = pending.get(target.strip())
        device = await self.store.approve(target, by=by, transport=transport)
        record_approval("operator")
        if request is None:  # approved by device id
            request = next((p for p in pending.values() if p.device_id == device.device_id), None)
        if request is not None:
            self.registry.reported(device.device_id, device.client_id, request.info)
        return device

    async def revoke(self, device_id: str, *, by: str) -> Provisioned:
        """Revoke the device's credentials and close its live link at once."""
        device = await self.store.revoke(device_id, by=by)
        self.registry.disconnect(device.device_id, REVOKED)
        return device

    def _credentials_lost(self, device_id: str, reason: str) -> None:
        """Another instance revoked or replaced the device's credential: close its link here,
        as a local revocation does."""
        self.registry.disconnect(device_id, reason)

    # ---- internals -------------------------------------------------------------------------------

    def _device_limited(
        self, kind: str, headers: proto.OtaHeaders, *, checked: bool
    ) -> Answer | None:
        """Charge the per-device budget: the device's own once its Client-Id is checked (the one
        it was approved with), else one of this (Device-Id, Client-Id) pair's, so a stranger with
        the device's MAC never spends the device's budget."""
        key = device_key(headers.device_id, headers.client_id, checked=checked)
        limited = self.limits.device_refusal(kind, key)
        return None if limited is None else refusal(429, limited, **{"Retry-After": "10"})

    def _remember_host(self, device_id: str, host: str | None) -> None:
        """The host the device reached us at: its vision URL uses it (a bounded table). Only
        for a request that passed the Client-Id check: a stranger's Host must never send a
        device's photos and token elsewhere."""
        if not host:
            return
        self._device_hosts.put(device_id, self._hostname(host))

    @property
    def _shared_token(self) -> str | None:
        token = self.settings.device_token
        if token is not None and token.get_secret_value():
            return token.get_secret_value()
        return read_token(self.settings.data_dir, DEVICE_TOKEN_FILE)

    async def _auto_approve(
        self, headers: proto.OtaHeaders, info: dict[str, Any], code: str | None
    ) -> Provisioned | None:
        enrollment: Enrollment | None = await self.store.lookup_enrollment(code) if code else None
        by: str | None = None
        transport: Transport | None = None
        if enrollment is not None and await self.store.use_enrollment(enrollment):
            by, transport = f"auto:enrollment:{enrollment.id}", enrollment.transport
        elif code is not None:
            self._refusals.warning(  # a stranger can send any code at line rate
                "unknown or used-up enrollment code",
                device_id=headers.device_id,
                remote=headers.remote,
            )
        if by is None and self._auto_macs and headers.device_id.startswith(self._auto_macs):
            existing = self.store.device(headers.device_id)
            if existing is None or not existing.active:
                by = "auto:mac-prefix"
        if by is None:
            return None
        device = await self.store.grant(
            headers.device_id,
            headers.client_id,
            serial_number=headers.serial_number,
            by=by,
            transport=transport,
        )
        record_approval("enrollment" if by.startswith("auto:enrollment") else "mac_prefix")
        return device

    def _activation(self, request: PendingActivation) -> dict[str, Any]:
        message = self.settings.activation_message.replace("{code}", request.code)
        return proto.activation_section(request.code, message, request.challenge)

    def _add_firmware(
        self, answer: dict[str, Any], device_id: str, info: dict[str, Any], host: str | None
    ) -> None:
        current = info.get("firmware_version")
        release = self.releases.offer(device_id, info.get("board_type"), current)
        if release is None:
            section = proto.no_upgrade(current)
            if section is not None:
                answer["firmware"] = section
            return
        # Host and this listener's port, not the request's base URL: stock firmware's HTTP
        # client may send Host without the port, as its WebSocket client does (§1.1).
        url = f"http://{self._hostname(host)}:{self.http_port}{self.settings.ota_path}"
        url += f"firmware/{release.board}/{release.version}"
        answer["firmware"] = proto.upgrade(release.version, url, release.sha256, release.size)
        log.info(
            "firmware offered",
            device_id=device_id,
            version=release.version,
            reported=current,
        )

    def _credentials(
        self, device: Provisioned, headers: proto.OtaHeaders, token: str, host: str | None
    ) -> dict[str, Any]:
        transport = device.transport or self.settings.device_transport
        if transport == "mqtt":
            access = self._mqtt_access(host)
            if access is not None:
                try:
                    return {
                        "mqtt": proto.mqtt_section(
                            access, device.device_id, headers.client_id, token
                        )
                    }
                except TopicError as exc:
                    log.warning(
                        "MQTT not possible for this device; WebSocket instead",
                        device_id=device.device_id,
                        reason=str(exc),
                    )
            elif not self._mqtt_warned:
                self._mqtt_warned = True
                log.warning(
                    "a device is set to MQTT but MQTT is not enabled (ota_mqtt_endpoint); "
                    "it gets WebSocket",
                    device_id=device.device_id,
                )
        return {"websocket": proto.websocket_section(self._websocket_url(host), token)}

    def _mqtt_access(self, host: str | None) -> proto.MqttAccess | None:
        """The broker devices are sent to: `ota_mqtt_endpoint`, else the bridge's own MQTT
        transport's (None when MQTT is off)."""
        endpoint = self.settings.ota_mqtt_endpoint or self._mqtt_endpoint(self._hostname(host))
        if endpoint is None:
            return None
        return proto.MqttAccess(
            endpoint, self.settings.mqtt_topic_prefix, shards=self.settings.mqtt_shards
        )

    def _websocket_url(self, host: str | None) -> str:
        if self.settings.ota_websocket_url:
            return self.settings.ota_websocket_url
        port = self._websocket_port()
        return f"ws://{self._hostname(host)}:{port}{self.settings.ws_path}"

    def _hostname(self, host: str | None) -> str:
        """The host the device reached us at (without port), else the configured one."""
        if host:
            name = host.strip()
            if not name.startswith("["):
                name = name.rsplit(":", 1)[0] if name.count(":") == 1 else name
            elif "]" in name:
                name = name[: name.index("]") + 1]
            if _HOSTNAME.match(name):
                return name
        configured = self.settings.ws_host
        return url_host(reachable_host(configured))


def credential_secret(settings: Settings, created: list[Path]) -> str:
    """The secret device tokens (and vision tokens) derive from: `device_secret` when set (the
    same on every instance of a cluster), else the data dir's file, created when missing."""
    configured = settings.device_secret
    if configured is not None and configured.get_secret_value().strip():
        return configured.get_secret_value().strip()
    return load_or_create_secret(settings.data_dir / SECRET_FILE, created)


class _Listener(uvicorn.Server):
    """uvicorn without its own signal handling: the bridge owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _owner_only(path: Path) -> None:
    """chmod 0600 the SQLite file and its WAL companions (SQLite gives new ones the same mode)."""
    for candidate in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(OSError):
            candidate.chmod(0o600)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP: TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock
