"""Long-running entry points behind `serve`, `demo` and `simulate`."""

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx
from rich.console import Console
from rich.markup import escape

from backend.auth import ADMIN_TOKEN_FILE
from backend.cli.network import network_addresses, urls_for
from backend.cli.output import listing, show
from backend.config import Settings
from backend.errors import BridgeError, listen_errors
from backend.logs import configure_logging
from backend.runtime import (
    data_dir_error,
    data_dir_lock,
    raise_open_file_limit,
    tune_gc_for_many_devices,
)
from backend.server import Bridge, stop_on_signals
from backend.transports.mqtt_setup import check_mqtt_settings

if TYPE_CHECKING:
    from backend.cli.voice import VoiceLink
    from simulator import MqttOptions


async def run_bridge(settings: Settings) -> None:
    """Run the bridge in the foreground (`serve`): lock the data dir, start, say where."""
    configure_logging(settings.log_level, settings.log_format)
    raise_open_file_limit()
    with (
        stop_on_signals() as stop,
        data_dir_lock(settings.data_dir),
        data_dir_errors(settings.data_dir),
    ):
        if settings.mqtt_url:
            check_mqtt_settings(settings)  # a settings mistake is named before a port is probed
        check_ports(settings)  # a port in use fails here, before any secret file is written
        bridge = Bridge(settings)
        for path in [*bridge.tokens.created, *bridge.secrets_created]:
            print(f"created secret file {path} (mode 0600)", flush=True)
        print(admin_token_line(settings), flush=True)
        for warning in auth_warnings(settings):
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        await bridge.start()
        tune_gc_for_many_devices()
        print(ready_line(bridge), flush=True)
        if settings.console_enabled:
            print(f"web console: {bridge.api_url}/ (log in with an API key or the admin token)")
        if bridge.mqtt is not None:
            mqtt = bridge.mqtt.endpoints()
            kind = "the bridge's own endpoint" if mqtt["mqtt_broker"] == "embedded" else "a broker"
            print(
                f"mqtt: devices at {mqtt['mqtt']} ({kind}, topics "
                f"{mqtt['mqtt_topic_prefix']}/<device>/up|down|status), udp audio at {mqtt['udp']}",
                flush=True,
            )
        await bridge.serve_forever(stop)


def admin_token_line(settings: Settings) -> str:
    """Where the admin token is, said at every start (never the token itself)."""
    if settings.admin_token is not None and settings.admin_token.get_secret_value():
        return "admin token: the one given (BRIDGE_ADMIN_TOKEN or admin_token in the config file)"
    return f"admin token: in {settings.data_dir / ADMIN_TOKEN_FILE} (log in to the console with it)"


def check_ports(settings: Settings) -> None:
    """Bind each configured fixed port for a moment: one already in use raises the same
    ListenError the listener would, before the bridge writes or opens anything."""
    listeners = [
        ("device WebSockets", settings.ws_host, settings.ws_port, "ws", socket.SOCK_STREAM),
        ("the admin API", settings.http_host, settings.http_port, "http", socket.SOCK_STREAM),
        (
            "device HTTP (OTA)",
            settings.device_http_host,
            settings.device_http_port,
            "device_http",
            socket.SOCK_STREAM,
        ),
    ]
    if settings.metrics_enabled and settings.metrics_port is not None:
        metrics = ("metrics", settings.metrics_host, settings.metrics_port, "metrics")
        listeners.append((*metrics, socket.SOCK_STREAM))
    if settings.mqtt_url:
        if settings.mqtt_url == "embedded":
            mqtt = ("devices over MQTT", settings.mqtt_host, settings.mqtt_port, "mqtt")
            listeners.append((*mqtt, socket.SOCK_STREAM))
        udp = ("UDP audio", settings.udp_host, settings.udp_port, "udp")
        listeners.append((*udp, socket.SOCK_DGRAM))
    for what, host, port, setting, kind in listeners:
        if port == 0:
            continue
        with (
            listen_errors(what, host, port, setting),
            socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind) as probe,
        ):
            if kind == socket.SOCK_STREAM:  # as the listeners: a port in TIME_WAIT is free
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))


def ready_line(bridge: Bridge) -> str:
    """Where devices reach the bridge: on a wildcard listener, this machine's network addresses
    (the loopback URL is of no use to a device); where the admin API is."""
    settings = bridge.settings
    ws = " or ".join(urls_for(settings.ws_host, bridge.ws_url))
    ota = " or ".join(urls_for(settings.device_http_host, bridge.provisioning.ota_url))
    line = f"bridge ready: devices at {ws} (OTA: {ota}), admin API at {bridge.api_url}"
    if not network_addresses(settings.ws_host):
        line += " (no network address found: only this machine can reach the device port)"
    return line


@contextlib.contextmanager
def data_dir_errors(data_dir: Path) -> Iterator[None]:
    """A file error under the data directory says so (raw errno text names neither it nor how
    to pick another one)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None or not _inside(Path(str(exc.filename)), data_dir):
            raise
        raise data_dir_error(data_dir, exc) from None


def _inside(path: Path, folder: Path) -> bool:
    return path.absolute().is_relative_to(folder.absolute())


def auth_warnings(settings: Settings) -> list[str]:
    """What `serve` says at start about a device auth weaker than per-device tokens."""
    warnings = []
    if settings.device_auth == "shared":
        warnings.append(
            'device_auth = "shared" (development mode): every device uses the one device '
            "token, and the OTA endpoint hands it to anyone who asks; use per-device tokens "
            '(device_auth = "device", the default) for real devices'
        )
    elif settings.device_auth == "off":
        warnings.append(
            'device_auth = "off": anyone who reaches the device port can connect as any device'
        )
    if settings.activation_auto_approve_macs:
        warnings.append(
            "activation_auto_approve_macs approves devices by MAC prefix; MAC addresses are easy "
            "to spoof: use it on a trusted network only"
        )
    return warnings


# The issue's own example: one turn that both changes the device and answers with sources.
DEMO_TURNS = ("Set the volume to 30 and tell me how long I should brush my teeth",)


async def run_demo(settings: Settings, console: Console, *, throwaway: bool = False) -> None:
    """The bridge plus one simulated device in one process: list, call, chat, keep serving.
    `throwaway`: the data directory is a temporary one (the caller removes it)."""
    configure_logging("warning", settings.log_format)
    with data_dir_lock(settings.data_dir), data_dir_errors(settings.data_dir):
        await _demo(settings, console, throwaway)


async def _demo(settings: Settings, console: Console, throwaway: bool) -> None:
    from simulator import SimulatedDevice

    if throwaway:
        print(
            f"data directory: {settings.data_dir} (temporary: removed when the demo stops; "
            "--data-dir DIR keeps one)",
            flush=True,
        )
    settings = await _offline_without_network(settings, console)
    bridge = Bridge(settings)
    await bridge.start()
    # The secure path in one process: the device enrols through the OTA endpoint with a
    # one-time enrollment code and connects with its own token.
    ota_url = bridge.provisioning.ota_url
    if settings.device_auth == "device":
        _enrollment, code = await bridge.provisioning.store.create_enrollment("demo", ttl_s=600)
        ota_url = bridge.provisioning.enrollment_url(code)
    device = SimulatedDevice(bridge.ws_url, None, index=1, ota_url=ota_url)
    device.hal.on_change = lambda what, value: console.print(
        f"  device: {what} = {value}", style="dim", markup=False, highlight=False
    )
    device.start()
    try:
        console.print(
            f"bridge: devices at {bridge.ws_url}, admin API at {bridge.api_url}", markup=False
        )
        await bridge.registry.wait_for_state(device.device_id, timeout_s=20)
        console.print(
            f"device {device.device_id} enrolled through {bridge.provisioning.ota_url} "
            "and connected with its own token",
            markup=False,
        )
        await _demo_calls(bridge, device.device_id, console)
        await _demo_chat(bridge, device.device_id, console)
        await _demo_voice(bridge, settings, console)
        if settings.console_enabled:
            console.print(
                f"web console: {bridge.api_url}/ (log in with the admin token, in "
                f"{settings.data_dir / ADMIN_TOKEN_FILE})",
                soft_wrap=True,
            )
        # Plain print: commands must paste whole, and rich wraps at 80 columns in a pipe.
        print("\n" + demo_hints(device.device_id, settings.data_dir), flush=True)
        await bridge.serve_forever()
    finally:
        await device.stop()
        await bridge.stop()


def demo_hints(device_id: str, data_dir: Path) -> str:
    """What to try from another terminal, as commands that paste (this executable's real path,
    the data directory quoted)."""
    cli = cli_command()
    where = f"--data-dir {shlex.quote(str(data_dir))}"
    commands = [
        f"{cli} devices {where}",
        f"{cli} call {device_id} self.audio_speaker.set_volume --arg volume=70 {where}",
        f"{cli} chat --device {device_id} {where}",
        f"{cli} simulate --say 'how often should I floss' {where}",
    ]
    return "Serving until Ctrl-C. From another terminal try:\n" + "\n".join(
        f"  {command}" for command in commands
    )


def cli_command() -> str:
    """How a shell runs this CLI: `esp32-bridge` when PATH finds this very script, else its path
    (relative to the working directory below it, e.g. `.venv/bin/esp32-bridge`), else
    `python -m backend.cli` with this interpreter."""
    script = Path(sys.executable).absolute().parent / "esp32-bridge"
    if not script.is_file():
        return f"{shlex.quote(sys.executable)} -m backend.cli"
    on_path = shutil.which("esp32-bridge")
    if on_path is not None and Path(on_path).resolve() == script.resolve():
        return "esp32-bridge"
    cwd = Path.cwd()
    if script.is_relative_to(cwd):
        relative = str(script.relative_to(cwd))
        return shlex.quote(relative if "/" in relative else f"./{relative}")
    return shlex.quote(str(script))


async def _demo_calls(bridge: Bridge, device_id: str, console: Console) -> None:
    headers = {"Authorization": f"Bearer {bridge.tokens.admin}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers) as api:
        tools = (await api.get(f"/api/devices/{device_id}/tools")).json()["tools"]
        table = listing(
            "tool", "description", ids=("tool",), prose=("description",),
            title=f"device {device_id}: {len(tools)} tools",
        )  # fmt: skip
        for tool in tools:
            table.add_row(tool["name"], tool["description"])
        show(table, console)
        for name, arguments in (
            ("self.audio_speaker.set_volume", {"volume": 42}),
            ("self.get_device_status", {}),
        ):
            response = await api.post(
                f"/api/devices/{device_id}/tools/call",
                json={"name": name, "arguments": arguments},
            )
            result = response.json()
            console.print(
                f"\ncall {name} {json.dumps(arguments)} → HTTP {response.status_code}",
                markup=False,
            )
            console.print_json(json.dumps(result))


def simulator_mqtt(
    settings: Settings, url: str | None, stock: bool, *, provisioned: bool = False
) -> tuple[str, "MqttOptions"]:
    """The broker URL and the options of `simulate --transport mqtt`: the local bridge's broker
    and topic prefix unless given. Passwords are derived from its credential secret, unless the
    devices are `provisioned` (their broker login then comes from the OTA answer)."""
    from backend.cli.output import fail
    from backend.runtime import read_runtime_file
    from backend.transports.mqtt_setup import MQTT_SECRET_FILE, device_credentials, mqtt_secret
    from simulator import MqttOptions

    endpoints = (read_runtime_file(settings.data_dir) or {}).get("endpoints") or {}
    url = url or endpoints.get("mqtt")
    if not url:
        raise fail("no broker: pass --mqtt mqtt://host:port or run `serve --mqtt ...` first", 2)
    prefix = endpoints.get("mqtt_topic_prefix") or settings.mqtt_topic_prefix
    # Worker processes (--workers) read these from the environment, as they do the device
    # token: other users can read a command line, not it.
    os.environ["BRIDGE_MQTT_TOPIC_PREFIX"] = prefix
    if provisioned:
        return url, MqttOptions(password=lambda _device_id: "", stock=stock, topic_prefix=prefix)
    has_secret = settings.mqtt_secret is not None or (settings.data_dir / MQTT_SECRET_FILE).exists()
    if not has_secret:
        raise fail(
            f"no MQTT credential secret in {settings.data_dir}: run `esp32-bridge serve --mqtt` "
            "once, or set BRIDGE_MQTT_SECRET",
            2,
        )
    credentials = device_credentials(settings)
    os.environ["BRIDGE_MQTT_SECRET"] = mqtt_secret(settings).decode()
    options = MqttOptions(
        password=lambda device_id: credentials.issue(device_id).password,
        stock=stock,
        topic_prefix=prefix,
    )
    return url, options


class WorkerFailed(BridgeError):
    """A simulator worker process ended with an error."""


# One simulator process comfortably keeps about this many devices busy; more go to workers.
DEVICES_PER_WORKER = 5000


def simulator_workers(devices: int, requested: int) -> int:
    """`--workers 0` (auto): one process per DEVICES_PER_WORKER devices, leaving one CPU to the
    bridge (usually on the same machine when one simulates a fleet)."""
    if requested > 0:
        return min(requested, devices)
    wanted = -(-devices // DEVICES_PER_WORKER)
    return max(1, min(wanted, (os.cpu_count() or 1) - 1))


async def _offline_without_network(settings: Settings, console: Console) -> Settings:
    """The settings, without the services that do not accept a connection, each said once in
    a short line (instead of a log line on the chat turn that finds it down): the model service
    (a fresh machine without Ollama: `llm_provider = none`, the demo chats in offline mode) and
    the web search (a machine without internet: `search_enabled = false`, sources come from
    the bundled knowledge base)."""
    searches = _search_urls(settings) if settings.search_enabled else {}
    model = settings.llm_provider != "none"
    urls = [settings.llm_base_url] if model else []
    reached = await asyncio.gather(*(_accepts(url) for url in [*urls, *searches.values()]))
    if model and not reached[0]:
        console.print(
            f"[dim]chat: no model service at {escape(settings.llm_base_url)}: offline mode "
            "(rules for device commands, quotes from the bundled knowledge base)"
        )
        settings = settings.model_copy(update={"llm_provider": "none"})
    if searches and not any(reached[len(urls) :]):
        console.print(
            f"[dim]chat: no web search reachable ({', '.join(searches)}): sources come from "
            "the bundled knowledge base"
        )
        settings = settings.model_copy(update={"search_enabled": False})
    return settings


# Where the web search providers are reached (backend/chat/search.py).
DUCKDUCKGO_URL = "https://html.duckduckgo.com/html/"


def _search_urls(settings: Settings) -> dict[str, str]:
    urls = {
        "duckduckgo": DUCKDUCKGO_URL,
        "google": settings.search_google_url,
        "searxng": settings.search_searxng_url or "",
    }
    return {name: urls[name] for name in settings.search_providers}


async def _accepts(url: str, timeout_s: float = 2.0) -> bool:
    """Whether the URL's host accepts a TCP connection (its name resolves, its port is open)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        async with asyncio.timeout(timeout_s):
            _reader, writer = await asyncio.open_connection(parts.hostname or "localhost", port)
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    return True


async def _demo_chat(bridge: Bridge, device_id: str, console: Console) -> None:
    """Scripted chat turns through the SSE chat API, printed as `esp32-bridge chat` does."""
    from backend.cli.chat import ChatPrinter

    printer = ChatPrinter(console)
    headers = {"Authorization": f"Bearer {bridge.tokens.admin}"}
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=300) as api:
        for text in DEMO_TURNS:
            console.print(f"\nyou> {text}", highlight=False, markup=False)
            body = {
                "message": text,
                "device_id": device_id,
                "conversation_id": printer.conversation_id,
            }
            async with api.stream("POST", "/api/chat/stream", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        printer.event(json.loads(line[len("data: ") :]))


# The demo's spoken ending: a command the embedded recognizer knows, acted on and answered aloud.
DEMO_SPOKEN_TURN = "set the volume to thirty"
DEMO_ANSWER_WAV = "demo-answer.wav"


async def _demo_voice(bridge: Bridge, settings: Settings, console: Console) -> None:
    """A stock-style voice device speaks DEMO_SPOKEN_TURN; the transcript, the tool call, the
    answer and where its audio was saved are printed. A bridge without voice says why."""
    from backend.cli import voice as spoken
    from simulator.fleet import device_id_for

    device_id = device_id_for(spoken.VOICE_DEVICE_INDEX)
    console.print(
        f'\nvoice device {device_id} says "{DEMO_SPOKEN_TURN}" (synthesized offline)',
        highlight=False,
        markup=False,
    )
    try:
        clip = await asyncio.to_thread(spoken.speech_clip, DEMO_SPOKEN_TURN, None)
        link = await _demo_voice_link(bridge)
        wav = settings.data_dir / DEMO_ANSWER_WAV
        turn = await spoken.hold_turn(link, device_id, clip, spoken.TurnOptions(), wav)
    except spoken.VoiceTurnFailed as exc:
        console.print(f"voice: no spoken turn: {exc}", highlight=False, markup=False)
        return
    spoken.print_turn(turn, console)


async def _demo_voice_link(bridge: Bridge) -> "VoiceLink":
    """An enrollment URL for the voice device (per-device tokens), else the shared token."""
    from backend.cli.voice import VoiceLink

    if bridge.settings.device_auth != "device":
        return VoiceLink("ws", bridge.ws_url, bridge.tokens.device)
    store = bridge.provisioning.store
    _enrollment, code = await store.create_enrollment("demo voice", ttl_s=600)
    return VoiceLink("ws", ota_url=bridge.provisioning.enrollment_url(code))


def enrollment_url(settings: Settings, devices: int, transport: str = "websocket") -> str:
    """An enrollment URL for `devices` simulated devices, made by the local bridge (an hour),
    that sends them to `transport` (websocket or mqtt)."""
    from backend.cli.client import AdminClient, AdminError
    from backend.cli.local import admin_token, admin_token_source, api_url_and_hint, local_ota_url
    from backend.cli.output import fail

    local_ota_url(settings)  # fails clearly when no bridge runs here
    token = admin_token(settings)
    if token is None:
        raise fail("no admin token to enrol the simulated devices: pass --ota or --token")
    body = {"name": "esp32-bridge simulate", "uses": devices, "ttl_s": 3600, "transport": transport}
    try:
        api, hint = api_url_and_hint(settings)
        source = admin_token_source(settings)
        with AdminClient(api, token, token_source=source, unreachable_hint=hint) as admin:
            created = admin.post("/api/provisioning/enrollment-codes", body)
    except AdminError as exc:
        raise fail(str(exc)) from None
    url: str = created["ota_url"]
    return url


async def run_simulator(
    url: str,
    token: str | None,
    count: int,
    extra_tools: int,
    console: Console,
    *,
    workers: int = 1,
    first_index: int = 1,
    mqtt: "MqttOptions | None" = None,
    ota_url: str | None = None,
) -> None:
    """`count` simulated devices: in this process, or split over `workers` child processes
    (each runs this command for its share; device indexes, hence ids, never overlap). With
    `ota_url` every device gets its URL and token from that OTA endpoint first."""
    if workers > 1:
        transport = [] if mqtt is None else ["--transport", "mqtt", "--mqtt", url]
        transport += ["--stock"] if mqtt is not None and mqtt.stock else []
        await _run_workers(
            url, token, count, extra_tools, console, workers, first_index, transport, ota_url
        )
        return
    from simulator import run_fleet

    tune_gc_for_many_devices()

    def log(*parts: Any) -> None:
        if count <= 10:
            console.print(
                " ".join(str(p) for p in parts), style="dim", markup=False, highlight=False
            )

    devices = await run_fleet(
        url,
        token,
        count,
        extra_tools=extra_tools,
        first_index=first_index,
        log=log,
        mqtt=mqtt,
        ota_url=ota_url,
    )
    last = first_index + count - 1
    where = f"{url}" if ota_url is None else "the bridge (URL and tokens from its OTA endpoint)"
    console.print(
        f"{count} simulated device(s) (indexes {first_index}-{last}) connecting to {where}; "
        "Ctrl-C stops them",
        markup=False,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.gather(*(device.stop() for device in devices))


async def _run_workers(
    url: str,
    token: str | None,
    count: int,
    extra_tools: int,
    console: Console,
    workers: int,
    first_index: int,
    transport: list[str],
    ota_url: str | None = None,
) -> None:
    shares = [count // workers + (1 if i < count % workers else 0) for i in range(workers)]
    # Token and OTA URL (it may hold an enrollment code) go through the environment: other
    # users can read a command line, not it.
    env = {**os.environ, "BRIDGE_DEVICE_TOKEN": token or ""}
    if ota_url is not None:
        env["BRIDGE_SIMULATE_OTA"] = ota_url
    children = []
    start = first_index
    for share in shares:
        argv = [
            sys.executable, "-m", "backend.cli", "simulate", "--url", url,
            "--devices", str(share), "--tools", str(extra_tools),
            "--first-index", str(start), "--workers", "1", *transport,
        ]  # fmt: skip
        children.append(await asyncio.create_subprocess_exec(*argv, env=env))
        start += share
    console.print(f"{count} simulated devices over {workers} worker processes; Ctrl-C stops them")
    # SIGTERM would end this process at once and orphan the workers: stop them first.
    loop = asyncio.get_running_loop()
    waiting = asyncio.ensure_future(asyncio.gather(*(child.wait() for child in children)))
    loop.add_signal_handler(signal.SIGTERM, waiting.cancel)
    try:
        try:
            codes = await waiting
        except asyncio.CancelledError:
            return  # SIGTERM: the workers are stopped below
        failed = [code for code in codes if code not in (0, -signal.SIGINT, -signal.SIGTERM)]
        if failed:
            raise WorkerFailed(f"{len(failed)} of {workers} simulator workers failed")
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        for child in children:
            if child.returncode is None:
                child.terminate()
        await asyncio.gather(*(child.wait() for child in children))
