"""The bridge process: device transports, the admin API and the database in one event loop.

`Bridge` wires the parts together and owns their lifecycle: the database opens first (a bad file
fails the start with one clear error), the catalogue loads every remembered device into the
registry, the chat front ends (keys, `/mcp`, device conversations: `backend.frontends`) start,
the transports start together and hand their links to one `DeviceGateway`, then the HTTP API.
`stop()` takes every device offline (pending calls fail with "bridge shutting down", links close
with 1001), stops the transports, the front ends and the API, and writes the catalogue's last
changes.
"""

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import structlog
from fastapi import FastAPI

from backend.api import create_app
from backend.api.device_events import DeviceStreams
from backend.api.listener import HttpListener, ListenerLimits
from backend.api.metrics import MetricsListener, metrics_app, metrics_router
from backend.api.provisioning import provisioning_router
from backend.auth import Tokens, ensure_tokens
from backend.cluster import CLUSTER_MIGRATIONS, ClusterNode, ClusterOptions
from backend.cluster.routes import cluster_router
from backend.common import reachable_host, tcp_listener, url_host
from backend.config import Settings
from backend.console import console_routes
from backend.devices import DeviceRegistry
from backend.devices.audit import AUDIT_MIGRATIONS, JOURNAL_FILE, AuditLog
from backend.devices.catalog import DEVICE_MIGRATIONS, DeviceCatalog
from backend.devices.confirm import ConfirmationPolicy
from backend.devices.conversation import ConversationHub
from backend.devices.gateway import DeviceGateway
from backend.devices.registry import SHUTDOWN
from backend.devices.state import EventKind
from backend.errors import listen_errors
from backend.frontends import FRONTEND_MIGRATIONS, FrontEnds
from backend.mcp_dialin.endpoint import DialInEndpoint, dialin_limits
from backend.mcp_servers.api import mcp_servers_router
from backend.mcp_servers.hub import McpServerHub
from backend.metrics import (
    measure_loop_lag,
    set_enabled,
    unwatch_cluster,
    unwatch_devices,
    watch_cluster,
    watch_devices,
)
from backend.provisioning.service import MIGRATIONS as PROVISIONING_MIGRATIONS
from backend.provisioning.service import Provisioning
from backend.runtime import remove_runtime_file, write_runtime_file
from backend.storage import Database, Migration
from backend.storage.database import DATABASE_FILE
from backend.transports.admission import (
    Admission,
    DeviceCredentials,
    NoDeviceAuth,
    SharedDeviceToken,
)
from backend.transports.base import Transport
from backend.transports.browser import BrowserTransport
from backend.transports.mqtt_setup import MqttService, mqtt_enabled
from backend.transports.websocket import WebSocketTransport

log = structlog.get_logger("bridge")

MIGRATIONS: tuple[Migration, ...] = (
    *DEVICE_MIGRATIONS,
    *FRONTEND_MIGRATIONS,
    *PROVISIONING_MIGRATIONS,
    *AUDIT_MIGRATIONS,
)


class Bridge:
    """Starts the transports, the admin API and the database; `stop()` drains them all."""

    def __init__(
        self,
        settings: Settings,
        tokens: Tokens | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` times the devices' rate limits (tests freeze it to make them exact)."""
        self.settings = settings
        self.tokens = tokens or ensure_tokens(settings)
        set_enabled(settings.metrics_enabled)  # the process's recorders (backend/metrics)
        self.registry = DeviceRegistry(
            max_pending_calls=settings.max_pending_calls,
            confirmation=ConfirmationPolicy(
                settings.confirm_tools, destructive_hint=settings.confirm_destructive_hint
            ),
        )
        self.conversations = ConversationHub(self.registry)
        clustered = CLUSTER_MIGRATIONS if settings.cluster_url is not None else ()
        self.database = Database(
            settings.database_url or settings.data_dir / DATABASE_FILE, (*MIGRATIONS, *clustered)
        )
        self.catalog = DeviceCatalog(self.database, self.registry)
        self.audit = AuditLog(
            self.database,
            self.registry,
            retention_s=settings.audit_retention_days * 86400.0,
            max_rows=settings.audit_max_rows,
            journal=settings.data_dir / JOURNAL_FILE,  # rows survive a kill -9
        )
        self.provisioning = self._provisioning(clock)
        self.admission = Admission(self._device_credentials(), self.provisioning.handshake_limits)
        self.gateway = DeviceGateway(
            self.registry, self.conversations, settings, self.provisioning.vision_capability
        )
        self.websocket = WebSocketTransport(settings, self.admission)
        # MQTT + UDP (docs/mqtt.md) when `mqtt_url` is set; `secrets_created` lists new files.
        self.secrets_created: list[Path] = []
        self.mqtt = self._mqtt_service()
        # Several instances on one fleet (docs/cluster.md): leases, fleet events, forwarding.
        self.cluster = self._cluster_node()
        # External MCP servers for the chat (docs/mcp-servers.md), shared by every conversation.
        self.mcp_servers = self._mcp_server_hub()
        self.frontends = FrontEnds(
            settings, self.database, self.registry, self.conversations, self.mcp_servers
        )
        # The talk page's browser devices (backend/transports/browser.py), with the console.
        self.browser = self._browser_transport()
        self.transports: list[Transport] = [
            transport
            for transport in (self.websocket, self.mqtt, self.browser)
            if transport is not None
        ]
        # Users' MCP servers dialing in join the hub while connected (backend/mcp_dialin).
        self.mcp_dialin = DialInEndpoint(
            self.mcp_servers, self.frontends.keys.resolve, dialin_limits(settings)
        )
        # The console's live fleet; a stream ends once its key is revoked.
        self.device_streams = DeviceStreams(self.registry, key_active=self.frontends.keys.active)
        self.app = self._app()
        # GET /metrics on a listener of its own too, when metrics_port is set.
        self.metrics_listener = self._metrics_listener()
        self._loop_lag: asyncio.Task[None] | None = None
        self._started: list[Transport] = []
        # The admin listener (backend/api/listener.py: head deadline, connection caps).
        self.api_listener: HttpListener | None = None
        self._stopped = False
        self._running = False

    # ---- the parts, built once by __init__ ---------------------------------------------------

    def _provisioning(self, clock: Callable[[], float]) -> Provisioning:
        """OTA endpoint, per-device credentials, firmware offers (docs/provisioning.md)."""
        return Provisioning(
            self.settings,
            self.database,
            self.registry,
            websocket_port=lambda: self.websocket.port,
            mqtt_endpoint=lambda hostname: (
                None if self.mqtt is None else self.mqtt.device_endpoint(hostname)
            ),
            created=self.tokens.created,
            clock=clock,
            audit=self.audit,  # a row per photo upload to the vision endpoint
        )

    def _mqtt_service(self) -> MqttService | None:
        if not mqtt_enabled(self.settings):
            return None
        return MqttService(
            self.settings,
            self.secrets_created,
            self.provisioning.store,
            self.provisioning.handshake_limits,
        )

    def _cluster_node(self) -> ClusterNode | None:
        if self.settings.cluster_url is None:
            return None
        return ClusterNode(
            ClusterOptions.of(self.settings),
            self.registry,
            self.database,
            mqtt=self.mqtt,
            dialins=lambda: [s for s in self.mcp_servers.listing() if s["kind"] == "dialin"],
        )

    def _mcp_server_hub(self) -> McpServerHub:
        hub = McpServerHub.from_settings(
            self.settings.mcp_servers,
            audit=lambda device_id, **detail: self.registry.emit(
                EventKind.TOOL_CALLED, device_id, **detail
            ),
        )
        if self.cluster is not None:  # dialed-in servers are listed by every instance
            hub.subscribe(self.cluster.dialins_changed)
        return hub

    def _browser_transport(self) -> BrowserTransport | None:
        if not self.settings.console_enabled:
            return None
        return BrowserTransport(
            self.settings,
            self.frontends.keys.active,
            self.provisioning.handshake_limits,
            voice_unavailable=self._voice_unavailable,
            subscribe=self.registry.subscribe,
        )

    def _app(self) -> FastAPI:
        """The admin listener's app: every API router and route of the parts above."""
        settings, cluster, browser = self.settings, self.cluster, self.browser
        return create_app(
            self.registry,
            self.tokens.admin,
            max_body_bytes=settings.max_http_body_bytes,
            resolve_key=self.frontends.keys.resolve,
            routers=[
                *self.frontends.routers(),
                provisioning_router(self.provisioning, self.audit),
                mcp_servers_router(
                    self.mcp_servers,
                    remote=cluster.remote_dialins if cluster is not None else None,
                    instance=cluster.instance_id if cluster is not None else None,
                ),
                *([metrics_router()] if settings.metrics_enabled else []),
                *([browser.router()] if browser is not None else []),
                cluster_router(cluster),
            ],
            routes=[
                *self.frontends.routes(),
                *self.mcp_dialin.routes,
                # Before the console's /console mount, which would take the WebSocket too.
                *(browser.routes if browser is not None else []),
                *(console_routes() if settings.console_enabled else []),
            ],
            cors_origins=settings.cors_origins,
            device_streams=self.device_streams,
            health=cluster.health if cluster is not None else lambda: None,
        )

    def _metrics_listener(self) -> MetricsListener | None:
        settings = self.settings
        if not settings.metrics_enabled or settings.metrics_port is None:
            return None
        return MetricsListener(
            metrics_app(self.tokens.admin, self.frontends.keys.resolve, auth=settings.metrics_auth),
            settings.metrics_host,
            settings.metrics_port,
            ListenerLimits.of(settings),
        )

    def _voice_unavailable(self) -> str | None:
        """Why devices get no voice on this bridge (the `VoiceUnavailableNotice` standing in for
        the voice loop says it); None when they do."""
        reason = getattr(self.frontends.voice, "reason", None)
        return reason if isinstance(reason, str) else None

    def _device_credentials(self) -> DeviceCredentials:
        mode = self.settings.device_auth
        if mode == "off":
            return NoDeviceAuth()
        if mode == "shared":
            assert self.tokens.device is not None, "ensure_tokens makes it in shared mode"
            return SharedDeviceToken(self.tokens.device)
        return self.provisioning.store  # each device's own token

    @property
    def ws_url(self) -> str:
        """The device WebSocket URL."""
        return self.websocket.url

    @property
    def http_port(self) -> int:
        """The bound port of the API listener."""
        assert self.api_listener is not None, "bridge not started"
        return self.api_listener.port

    @property
    def api_url(self) -> str:
        """The API's base URL."""
        return f"http://{url_host(reachable_host(self.settings.http_host))}:{self.http_port}"

    def endpoints(self) -> dict[str, str]:
        """The device endpoints of every started transport, by name."""
        found: dict[str, str] = {}
        for transport in self._started:
            found.update(transport.endpoints())
        return found

    async def start(self) -> None:
        """Start everything; on any failure, stop what started and raise."""
        try:
            await self.database.open()
            await self.catalog.load()
            self.catalog.start()
            await self.frontends.start()
            await self.mcp_servers.start()
            await self.provisioning.start()
            self.audit.start()
            if self.cluster is not None:
                await self.cluster.start()
            for transport in self.transports:
                await transport.start(self.gateway)
                self._started.append(transport)
            await self._start_api()
            if self.cluster is not None:
                await self.cluster.leases.set_api_url(self.api_url)
            await self.provisioning.start_listener()
            await self._start_metrics()
        except BaseException:
            await self.stop()
            raise
        self._running = True
        write_runtime_file(
            self.settings.data_dir,
            {
                "ws_url": self.ws_url,
                "api_url": self.api_url,
                "ota_url": self.provisioning.ota_url,
                "device_auth": self.settings.device_auth,
                "endpoints": self.endpoints(),
            },
        )
        log.info(
            "bridge listening", api=self.api_url, ota=self.provisioning.ota_url, **self.endpoints()
        )

    async def _start_metrics(self) -> None:
        if not self.settings.metrics_enabled:
            return
        watch_devices(self.registry)
        if self.cluster is not None:
            watch_cluster(self.cluster)  # bridge_cluster_*: only a clustered bridge has them
        self._loop_lag = asyncio.create_task(measure_loop_lag(), name="event-loop-lag")
        if self.metrics_listener is not None:
            await self.metrics_listener.start()
            if not self.settings.metrics_auth:
                log.warning("metrics served without a key", url=self.metrics_listener.url)

    async def _stop_metrics(self) -> None:
        unwatch_devices(self.registry)
        if self.cluster is not None:
            unwatch_cluster(self.cluster)
        if self._loop_lag is not None:
            self._loop_lag.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_lag
            self._loop_lag = None
        if self.metrics_listener is not None:
            await self.metrics_listener.stop()

    async def _start_api(self) -> None:
        host, port = self.settings.http_host, self.settings.http_port
        with listen_errors("the admin API", host, port, "http"):
            sock = tcp_listener(host, port)
        self.api_listener = HttpListener(
            self.app,
            sock,
            ListenerLimits.of(self.settings),
            "admin",
            # The only WebSocket here is the MCP endpoint: a bigger frame is refused (1009)
            # before it is buffered whole.
            ws_max_size=self.settings.mcp_endpoint_max_frame_bytes,
        )
        await self.api_listener.start("admin API")

    async def stop(self) -> None:
        """Take devices offline (pending calls fail, links close 1001), then drain the rest."""
        if self._stopped:
            return
        self._stopped = True
        if self._running:
            log.info("bridge stopping", devices=len(self.registry))
        if self.cluster is not None:
            await self.cluster.stop()  # leases given up, presence cleared: others drop ours
        self.registry.shutdown(SHUTDOWN)
        await self._stop_metrics()
        await self.provisioning.stop_listener()
        for transport in reversed(self._started):
            await transport.stop()
        await self.frontends.stop_sessions()
        await self.mcp_dialin.stop()
        await self.mcp_servers.stop()
        # Endless event streams end first: the HTTP server waits for its open responses.
        self.device_streams.close()
        if self.api_listener is not None:
            await self.api_listener.stop()
        await self.frontends.close()
        if self.database.is_open:
            with contextlib.suppress(Exception):
                await self.catalog.stop()
            with contextlib.suppress(Exception):
                await self.audit.stop()
            with contextlib.suppress(Exception):
                await self.provisioning.stop()
            await self.database.close()
        remove_runtime_file(self.settings.data_dir)
        if self._running:
            log.info("bridge stopped")
        self._running = False

    async def serve_forever(self, stop: asyncio.Event | None = None) -> None:
        """Run until `stop` is set (by default: until SIGINT/SIGTERM), then stop gracefully."""
        try:
            if stop is not None:
                await stop.wait()
                await self._drain_first(stop)
            else:
                with stop_on_signals() as stopped:
                    await stopped.wait()
                    await self._drain_first(stopped)
        finally:
            await self.stop()

    async def _drain_first(self, stop: asyncio.Event) -> None:
        """In a cluster, a stop (SIGTERM: a rolling restart) drains first, hitlessly
        (docs/cluster.md, "Drain and rolling upgrade"); a second signal stops at once."""
        if self.cluster is None:
            return
        stop.clear()
        draining = asyncio.ensure_future(self.cluster.drain())
        again = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait((draining, again), return_when=asyncio.FIRST_COMPLETED)
        finally:
            again.cancel()
            if not draining.done():
                log.warning("stopping before the drain finished (second signal)")
                draining.cancel()
            elif draining.exception() is not None:
                log.error("drain failed", error=repr(draining.exception()))

    async def __aenter__(self) -> "Bridge":
        await self.start()
        return self

    async def __aexit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        await self.stop()


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event SIGINT and SIGTERM set while the block runs. Installed before a bridge starts,
    a SIGTERM that arrives as it writes bridge.json stops it gracefully instead of killing it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
