"""`esp32-bridge`: run the bridge, a simulated fleet or the demo; list and call device tools."""

import asyncio
import contextlib
import difflib
import importlib.metadata
import json
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from backend.cli import helpstyle, output
from backend.cli.audit import audit as audit_command
from backend.cli.chat import chat as chat_command
from backend.cli.client import AdminClient, AdminError
from backend.cli.cluster import cluster_app
from backend.cli.devices import devices_app
from backend.cli.firmware import firmware_app
from backend.cli.keys import keys_app
from backend.cli.local import (
    cli_settings,
    device_auth_mode,
    device_endpoint,
    device_token,
)
from backend.cli.mcp import mcp_app
from backend.cli.mqtt import mqtt_app
from backend.cli.options import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    ServerOpt,
    TokenOpt,
    WideOpt,
    admin_client,
)
from backend.cli.output import Listing, console, fail, listing, print_json, say, show
from backend.cli.voice import VOICE_DEVICE_INDEX
from backend.config import Settings
from backend.errors import BridgeError, ListenError

if TYPE_CHECKING:
    from backend.cli.voice import TurnOptions

app = typer.Typer(
    help="Bridge for xiaozhi-compatible ESP32 devices: each device's tools over MCP.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
helpstyle.apply()

# The distribution this CLI belongs to (pyproject.toml's project name).
DISTRIBUTION = "esp32-mcp-bridge"


def _print_version(value: bool) -> None:
    if value:
        try:
            version = importlib.metadata.version(DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown (not installed)"
        say(f"esp32-bridge ({DISTRIBUTION}) {version}")
        raise typer.Exit()


@app.callback()
def _options(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=_print_version,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """Bridge for xiaozhi-compatible ESP32 devices: each device's tools over MCP."""


app.add_typer(firmware_app, name="firmware")
app.add_typer(mqtt_app, name="mqtt")

WsPortOpt = Annotated[
    int | None, typer.Option("--ws-port", metavar="PORT", help="Device WebSocket port.")
]
HttpPortOpt = Annotated[
    int | None, typer.Option("--http-port", metavar="PORT", help="Admin API port.")
]
DeviceHttpPortOpt = Annotated[
    int | None,
    typer.Option(
        "--device-http-port", metavar="PORT", help="Device HTTP port (OTA, activation, firmware)."
    ),
]


# ---- serve / demo / simulate ------------------------------------------------------------------


MqttOpt = Annotated[
    str | None,
    typer.Option(
        "--mqtt",
        metavar="URL",
        help="MQTT + UDP transport: 'embedded' (the bridge's own endpoint) or mqtt\\[s]://\\[user:pass@]"
        "host:port of an external broker \\[env: BRIDGE_MQTT_URL, which keeps a password off ps].",
    ),
]
MqttPortOpt = Annotated[
    int | None,
    typer.Option("--mqtt-port", metavar="PORT", help="Port of the embedded MQTT endpoint (1883)."),
]
UdpPublicHostOpt = Annotated[
    str | None,
    typer.Option(
        "--udp-public-host", metavar="HOST", help="Address devices send UDP audio to (MQTT only)."
    ),
]


@app.command()
def serve(
    config: ConfigOpt = None,
    data_dir: DataDirOpt = None,
    ws_port: WsPortOpt = None,
    http_port: HttpPortOpt = None,
    mqtt: MqttOpt = None,
    mqtt_port: MqttPortOpt = None,
    udp_public_host: UdpPublicHostOpt = None,
    device_http_port: DeviceHttpPortOpt = None,
) -> None:
    """Run the bridge: device WebSocket endpoint (and MQTT + UDP), device HTTP (OTA) and admin
    API, until Ctrl-C."""
    from backend.cli.runs import run_bridge

    settings = cli_settings(
        config,
        data_dir=data_dir,
        ws_port=ws_port,
        http_port=http_port,
        mqtt_url=mqtt,
        mqtt_port=mqtt_port,
        udp_public_host=udp_public_host,
        device_http_port=device_http_port,
    )
    _run(run_bridge(settings))


@app.command()
def demo(
    config: ConfigOpt = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            "--data-dir",
            metavar="DIR",
            help="Keep the demo's data here \\[default: a temporary directory, removed at exit].",
        ),
    ] = None,
    ws_port: WsPortOpt = None,
    http_port: HttpPortOpt = None,
    device_http_port: DeviceHttpPortOpt = None,
) -> None:
    """Start the bridge and one simulated device, call two tools, keep serving until Ctrl-C.

    Its data (tokens, database, the device) goes to a temporary directory unless --data-dir is
    given, so a later `serve` starts clean."""
    from backend.cli.runs import run_demo

    throwaway = data_dir is None
    if data_dir is None:
        data_dir = Path(tempfile.mkdtemp(prefix="esp32-bridge-demo-"))
    try:
        settings = cli_settings(
            config,
            data_dir=data_dir,
            ws_port=ws_port,
            http_port=http_port,
            device_http_port=device_http_port,
        )
        with _terminate_as_interrupt():
            _run(run_demo(settings, console, throwaway=throwaway))
    finally:
        if throwaway:
            shutil.rmtree(data_dir, ignore_errors=True)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C (cleanup runs: the demo's temporary directory is removed)."""

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


SayOpt = Annotated[
    str | None,
    typer.Option(
        "--say",
        metavar="TEXT",
        help="Voice: one device speaks this sentence (synthesized offline).",
    ),
]
SpeakOpt = Annotated[
    Path | None,
    typer.Option(
        "--speak", metavar="FILE", help="Voice: one device speaks this mono 16-bit WAV file."
    ),
]
SaveOpt = Annotated[
    Path | None,
    typer.Option(
        "--save",
        metavar="FILE",
        help="Voice: WAV file for what the device heard; its events go to FILE.events.jsonl "
        "\\[default: answer.wav in a new directory under the system's temp dir].",
    ),
]
CodecOpt = Annotated[
    str, typer.Option("--codec", metavar="CODEC", help="Voice: uplink audio, opus or pcm16.")
]
ProtocolVersionOpt = Annotated[
    int,
    typer.Option(
        "--protocol-version",
        metavar="N",
        min=1,
        max=3,
        help="Voice: WebSocket binary protocol 1, 2 or 3.",
    ),
]
ModeOpt = Annotated[
    str,
    typer.Option(
        "--mode",
        metavar="MODE",
        help="Voice: auto (the bridge hears the end) or manual (listen stop ends it).",
    ),
]


@app.command()
def simulate(
    url: Annotated[
        str | None, typer.Option("--url", metavar="URL", help="Device endpoint ws:// URL.")
    ] = None,
    devices: Annotated[
        int,
        typer.Option(
            "--devices", metavar="N", min=1, help="How many simulated devices (1 or more)."
        ),
    ] = 1,
    tools: Annotated[
        int, typer.Option("--tools", metavar="N", min=0, help="Extra synthetic tools.")
    ] = 0,
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            metavar="N",
            min=0,
            help="Processes to spread the devices over (0: one per 5,000).",
        ),
    ] = 0,
    first_index: Annotated[
        int | None,
        typer.Option(
            "--first-index",
            metavar="N",
            min=1,
            help="Index of the first device (its id) \\[default: 1; the voice device: "
            f"{VOICE_DEVICE_INDEX}, apart from a fleet's].",
        ),
    ] = None,
    token: Annotated[
        str | None, typer.Option("--token", metavar="TOKEN", help="Device token.")
    ] = None,
    transport: Annotated[
        str,
        typer.Option(
            "--transport", metavar="TRANSPORT", help="ws (WebSocket) or mqtt (MQTT + UDP)."
        ),
    ] = "ws",
    mqtt: Annotated[
        str | None,
        typer.Option(
            "--mqtt", metavar="URL", help="Broker mqtt://host:port \\[default: the local bridge's]."
        ),
    ] = None,
    stock: Annotated[
        bool,
        typer.Option(
            "--stock",
            help="MQTT: behave like stock firmware (GID_ client id, no will, no subscription).",
        ),
    ] = False,
    ota: Annotated[
        str | None,
        typer.Option(
            "--ota",
            metavar="URL",
            envvar="BRIDGE_SIMULATE_OTA",
            help="OTA URL the devices ask for their URL and token (an enrollment URL approves "
            "them at once) \\[default: a local bridge in device mode enrols them].",
        ),
    ] = None,
    say: SayOpt = None,
    speak: SpeakOpt = None,
    save: SaveOpt = None,
    codec: CodecOpt = "opus",
    protocol_version: ProtocolVersionOpt = 1,
    mode: ModeOpt = "auto",
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Connect N simulated devices (the real firmware code on a fake HAL) to a bridge, or with
    --say/--speak one stock-style voice device that speaks one turn.

    Against a bridge with per-device tokens (the default) each device enrols itself through
    the OTA endpoint, with an enrollment code for N devices that this command creates through
    the local bridge's admin API; with --token (or a bridge in shared mode) they share a token.
    Over MQTT they enrol the same way and log in to the broker with the token the OTA answer
    gives them (against a bridge in shared mode, or with --mqtt, with derived credentials).

    --say TEXT (synthesized offline) or --speak FILE.wav: the voice device streams the speech
    (--codec opus|pcm16), waits for the spoken answer, prints the transcript, the tool calls it
    received and the answer, and saves what it heard to --save (default: answer.wav in a new
    directory under the system's temp dir) with the events next to it (.events.jsonl)."""
    from backend.cli.runs import (
        enrollment_url,
        run_simulator,
        simulator_mqtt,
        simulator_workers,
    )

    settings = cli_settings(config, data_dir=data_dir)
    if transport not in ("ws", "mqtt"):
        raise fail(f"--transport must be ws or mqtt, got {transport!r}", 2)
    if say is not None or speak is not None:
        voice = VoiceRequest(say, speak, save, codec, protocol_version, mode)
        _simulate_voice(
            settings, voice, devices, first_index, transport, url, token, mqtt, stock, ota
        )
        return
    options = None
    if transport == "mqtt":
        if ota is None and mqtt is None and device_auth_mode(settings) == "device":
            ota = enrollment_url(settings, devices, "mqtt")
        url, options = simulator_mqtt(settings, mqtt, stock, provisioned=ota is not None)
    else:
        no_credentials = token is None and url is None and device_token(settings) is None
        if ota is None and no_credentials and device_auth_mode(settings) == "device":
            ota = enrollment_url(settings, devices)
        if ota is None:
            url, token = device_endpoint(settings, url, token)
    processes = simulator_workers(devices, workers)
    _run(
        run_simulator(
            url or "",
            token,
            devices,
            tools,
            console,
            workers=processes,
            first_index=first_index or 1,
            mqtt=options,
            ota_url=ota,
        )
    )


@dataclass(frozen=True)
class VoiceRequest:
    """What `simulate --say/--speak` asks the simulated devices to say, and how."""

    say: str | None
    speak: Path | None
    save: Path | None
    codec: str
    protocol_version: int
    mode: str


def _simulate_voice(
    settings: Settings,
    voice: VoiceRequest,
    devices: int,
    first_index: int | None,
    transport: str,
    url: str | None,
    token: str | None,
    mqtt: str | None,
    stock: bool,
    ota: str | None,
) -> None:
    """`simulate --say/--speak`: one voice device, one spoken turn."""
    from backend.cli import voice as spoken

    options = _turn_options(voice, devices)
    try:
        clip = spoken.speech_clip(voice.say, voice.speak)
    except spoken.VoiceTurnFailed as exc:
        raise fail(str(exc)) from None
    device_id = spoken.device_id_for(first_index or VOICE_DEVICE_INDEX)
    link = spoken.link_from_settings(
        settings, "mqtt" if transport == "mqtt" else "ws", device_id,
        url=url, token=token, mqtt=mqtt, stock=stock, ota=ota,
    )  # fmt: skip
    wav = voice.save or spoken.default_wav_path()
    _run(spoken.run_voice_turn(link, device_id, clip, options, wav, console, output.err_console))


def _turn_options(voice: VoiceRequest, devices: int) -> "TurnOptions":
    from backend.cli.voice import TurnOptions

    if voice.say is not None and voice.speak is not None:
        raise fail("--say and --speak exclude each other: give one", 2)
    if devices != 1:
        raise fail("--say/--speak simulate one voice device: drop --devices", 2)
    if voice.codec not in ("opus", "pcm16"):
        raise fail(f"--codec must be opus or pcm16, got {voice.codec!r}", 2)
    if voice.mode not in ("auto", "manual"):
        raise fail(f"--mode must be auto or manual, got {voice.mode!r}", 2)
    return TurnOptions(
        codec="opus" if voice.codec == "opus" else "pcm16",
        protocol_version=voice.protocol_version,
        mode="auto" if voice.mode == "auto" else "manual",
    )


# ---- admin commands ---------------------------------------------------------------------------


@app.command("forget")
def forget_device(
    device: Annotated[
        str, typer.Argument(metavar="DEVICE", help="Device id of an offline device.")
    ],
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Remove an offline device and its cached tools from the catalogue."""
    with admin_client(server, token, data_dir, config) as admin:
        admin.forget(device)
    say(f"forgot {device}")


@app.command("tools")
def list_tools(
    device: Annotated[
        str, typer.Argument(metavar="DEVICE", help="Device id, e.g. a4:cf:12:34:56:78.")
    ],
    user: Annotated[bool, typer.Option("--user/--no-user", help="Include user-only tools.")] = True,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """List one device's tools; a risky one (reboot, upgrade, settings: the confirm_tools
    setting, or an MCP destructiveHint) runs only with `call --confirm`."""
    with admin_client(server, token, data_dir, config) as admin:
        listed = admin.tools(device, include_user_only=user)
    if as_json:
        print_json(listed)
        return
    if listed["cached"]:
        read_at = listed.get("read_at") or "an unknown time"
        say(f"{device} is offline: cached tools, read at {read_at}")
    table = tools_table(listed["tools"], wide=wide)
    show(table)
    if any(row[-1].plain for row in table.rows):
        say(f"risky tools run only when confirmed: esp32-bridge call {device} TOOL --confirm")


def tools_table(tools: list[dict[str, Any]], *, wide: bool = False) -> Listing:
    """The `tools` table: name, arguments, description, audience and whether it is risky (the
    bridge says so in the listing: its confirmation rules for this device)."""
    table = listing(
        "name", "arguments", "description", "audience", "risky",
        ids=("name",), prose=("arguments", "description"), wide=wide,
    )  # fmt: skip
    for tool in tools:
        annotations = tool.get("annotations") or {}
        table.add_row(
            tool["name"],
            _describe_arguments(tool.get("inputSchema") or {}),
            tool.get("description") or "",
            ", ".join(annotations.get("audience", [])),
            "yes" if tool.get("needs_confirmation") else "",
        )
    return table


@app.command("call")
def call_tool(
    device: Annotated[str, typer.Argument(metavar="DEVICE", help="Device id.")],
    tool: Annotated[
        str,
        typer.Argument(metavar="TOOL", help="Tool name, e.g. self.audio_speaker.set_volume."),
    ],
    arguments: Annotated[
        str | None,
        typer.Argument(
            metavar="ARGUMENTS", help="Arguments as a JSON object, e.g. '{\"volume\": 42}'."
        ),
    ] = None,
    arg: Annotated[
        list[str] | None,
        typer.Option(
            "--arg",
            metavar="NAME=VALUE",
            help="One argument (the value is JSON, or else a string); repeatable.",
        ),
    ] = None,
    timeout: Annotated[
        float | None, typer.Option("--timeout", metavar="SECONDS", help="How long to wait.")
    ] = None,
    confirm: Annotated[
        bool,
        typer.Option("--confirm", help="Confirm a risky tool (reboot, upgrade, settings)."),
    ] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Call one tool on one device and print its result.

    An argument name the tool does not take is refused before the call is sent, with the
    names it takes."""
    args = _parse_arguments(arguments, arg or [])
    with admin_client(server, token, data_dir, config) as admin:
        if args:
            _check_argument_names(admin, device, tool, args)
        result = admin.call(device, tool, args, timeout, confirm=confirm)
    for item in result["content"]:
        text = item.get("text") if item.get("type") == "text" else json.dumps(item)
        say(str(text))
    if result["isError"]:
        raise fail(f"{tool} reported an error ({result['duration_ms']:.1f} ms)")


def _check_argument_names(
    admin: AdminClient, device: str, tool: str, arguments: dict[str, Any]
) -> None:
    """Refuse an argument name `tool`'s inputSchema does not have (usage error, exit 2). Any
    doubt (no such device or tool, a schema that takes any name) is left to the call itself."""
    try:
        listed = admin.tools(device, include_user_only=True)
    except AdminError:
        return
    schema = next((t.get("inputSchema") for t in listed["tools"] if t["name"] == tool), None)
    message = unknown_argument(tool, schema, arguments)
    if message is not None:
        raise fail(message, 2)


def unknown_argument(tool: str, schema: Any, arguments: dict[str, Any]) -> str | None:
    """`unknown argument "vol"; did you mean "volume"? ...` for the first argument name the
    schema's `properties` lack, or None: all known, or a schema that lists no properties or
    takes other names too (`additionalProperties`: true or a schema)."""
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
        return None
    extra = schema.get("additionalProperties")
    if extra is True or isinstance(extra, dict):
        return None
    names = [str(name) for name in schema["properties"]]
    for given in arguments:
        if given in names:
            continue
        message = f'unknown argument "{given}"'
        close = difflib.get_close_matches(given, names, n=1, cutoff=0.5)
        if close:
            message += f'; did you mean "{close[0]}"?'
        takes = ", ".join(names) if names else "no arguments"
        return f"{message} ({tool} takes {takes})"
    return None


app.command("chat")(chat_command)
app.add_typer(keys_app, name="keys")
app.add_typer(devices_app, name="devices")
app.add_typer(mcp_app, name="mcp")
app.add_typer(cluster_app, name="cluster")
app.command("audit")(audit_command)
helpstyle.tidy_app(app)


# ---- helpers ----------------------------------------------------------------------------------


def _parse_arguments(raw: str | None, pairs: list[str]) -> dict[str, Any]:
    arguments: dict[str, Any] = {}
    if raw:
        try:
            arguments = json.loads(raw)
        except ValueError as exc:
            raise fail(f"arguments are not valid JSON: {exc}", 2) from None
        if not isinstance(arguments, dict):
            raise fail("arguments must be a JSON object", 2)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise fail(f"--arg expects key=value, got {pair!r}", 2)
        try:
            arguments[key] = json.loads(value)
        except ValueError:
            arguments[key] = value  # a bare word is a string
    return arguments


def _describe_arguments(schema: dict[str, Any]) -> str:
    required = set(schema.get("required") or [])
    parts = []
    for name, prop in (schema.get("properties") or {}).items():
        kind = prop.get("type", "any") if isinstance(prop, dict) else "any"
        parts.append(f"{name}: {kind}" + ("" if name in required else "?"))
    return ", ".join(parts)


def _run(coro: Any) -> None:
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass
    except ListenError as exc:
        raise fail(listen_advice(exc)) from None
    except (OSError, BridgeError) as exc:  # an unusable database...
        raise fail(str(exc)) from None


# The command-line flag of each listener's port (`serve --help`); the others have settings only.
PORT_FLAGS = {
    "ws": "--ws-port",
    "http": "--http-port",
    "device_http": "--device-http-port",
    "mqtt": "--mqtt-port",
}


def listen_advice(exc: ListenError) -> str:
    """The bind failure, with the flag, variable and config key that move it."""
    port, host = f"{exc.setting}_port", f"{exc.setting}_host"
    flag = PORT_FLAGS.get(exc.setting)
    where = f"{flag}, " if flag else ""
    busy = "in use" in exc.reason
    hint = " (another program, maybe another bridge, listens there)" if busy else ""
    return (
        f"{exc}{hint}: choose another port with {where}BRIDGE_{port.upper()} or {port} in "
        f"the config file, another address with BRIDGE_{host.upper()} or {host}"
    )


def main() -> None:
    """The `esp32-bridge` entry point."""
    app()
