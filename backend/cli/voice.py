"""`esp32-bridge simulate --say/--speak`, and the demo's spoken ending: one stock-style voice
device (`simulator.voice_client.VoiceDevice`) speaks a clip to the bridge, waits for the answer
(up to its `tts stop`) and saves what it heard as a WAV file, with the events it received as
JSON lines next to it (`<name>.events.jsonl`).

The voice packages (the `voice` extra) are imported only when a turn is held, so the rest of
the CLI works without them."""

import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import httpx
from rich.console import Console
from rich.text import Text

from backend.errors import BridgeError

if TYPE_CHECKING:
    from backend.config import Settings
    from backend.voice.audio import Clip
    from simulator.voice_client import VoiceDevice, VoiceReply

Codec = Literal["opus", "pcm16"]
Mode = Literal["auto", "manual"]
Transport = Literal["ws", "mqtt"]
T = TypeVar("T")
Progress = Callable[[str], None]  # told each stage of a turn as it starts

MCP_READY_TIMEOUT_S = 10.0  # the bridge lists the device's tools right after the hello
ANSWER_TIMEOUT_S = 30.0
ALERT_CHECK_S = 0.05
VOICE_DEVICE_INDEX = 1000  # its id, 02:00:00:00:03:e8, never clashes with a small fleet's
VOICE_UNAVAILABLE = "voice unavailable"  # the alert status of a bridge without voice


class VoiceTurnFailed(BridgeError):
    """The spoken turn could not be held; the message is one line for the operator."""


@dataclass(frozen=True)
class VoiceLink:
    """How the voice device reaches the bridge. `ota_url`: ask that OTA (or enrollment) URL for
    the rest first. Over MQTT `token` is the broker password."""

    transport: Transport = "ws"
    url: str = ""
    token: str | None = None
    ota_url: str | None = None
    username: str | None = None
    topic_prefix: str = "xiaozhi"
    subscribe: bool = False


@dataclass(frozen=True)
class TurnOptions:
    """How a simulated device speaks a turn: codec, protocol version, listen mode, timeout."""

    codec: Codec = "opus"
    protocol_version: int = 1  # WebSocket only: the MQTT hello is always version 3
    mode: Mode = "auto"
    answer_timeout_s: float = ANSWER_TIMEOUT_S


@dataclass(frozen=True)
class SpokenTurn:
    """The turn as the device lived it, and where it was saved."""

    device_id: str
    transcript: str | None
    sentences: list[str]
    tool_calls: list[tuple[str, dict[str, Any]]]
    answer_ms: float
    wav: Path
    events: Path


# ---- the speech and the files ------------------------------------------------------------------


def speech_clip(say: str | None, speak: Path | None, language: str = "en") -> "Clip":
    """The sentence synthesized offline (eSpeak NG), or the WAV file, at 16 kHz."""
    from backend.voice.errors import VoiceUnavailable

    try:
        from backend.voice.audio import read_wav
        from backend.voice.tts import render
        from simulator.voice_client import to_uplink_rate
    except ImportError as exc:
        missing = f"voice packages missing ({exc.name}): pip install '.[voice]'"
        raise VoiceTurnFailed(missing) from None
    try:
        clip = render(say, language, 16000) if say is not None else read_wav(_path(speak))
    except (OSError, ValueError) as exc:
        raise VoiceTurnFailed(f"cannot read {speak}: {exc}") from None
    except VoiceUnavailable as exc:
        raise VoiceTurnFailed(f"cannot synthesize speech: {exc}") from None
    if clip.duration_ms == 0:
        raise VoiceTurnFailed("nothing to say: the speech is empty")
    return to_uplink_rate(clip)


def _path(speak: Path | None) -> Path:
    assert speak is not None, "--say or --speak"
    return speak


def default_wav_path() -> Path:
    """A fresh directory under the system's temp dir, so runs never overwrite each other."""
    return Path(tempfile.mkdtemp(prefix="esp32-bridge-voice-")) / "answer.wav"


def events_path(wav: Path) -> Path:
    """`answer.wav` -> `answer.events.jsonl`."""
    return wav.with_suffix(".events.jsonl")


# ---- enrolment ---------------------------------------------------------------------------------


async def enrol(link: VoiceLink, device_id: str, client_id: str) -> VoiceLink:
    """The link with the URL and credentials the OTA endpoint hands this device (a stock OTA
    check); `link` itself when it has no OTA URL."""
    if link.ota_url is None:
        return link
    answer = await _ota_check(link.ota_url, device_id, client_id)
    activation = answer.get("activation")
    if isinstance(activation, dict):
        raise VoiceTurnFailed(
            f"the bridge asks to activate {device_id} with code {activation.get('code')}: "
            "approve it (esp32-bridge devices), or pass an enrollment URL as --ota"
        )
    if link.transport == "mqtt":
        return _mqtt_link(link, answer, device_id)
    section = answer.get("websocket")
    if not isinstance(section, dict) or not isinstance(section.get("url"), str):
        raise VoiceTurnFailed("the OTA answer has no websocket section")
    token = section.get("token")
    return replace(link, url=section["url"], token=token if isinstance(token, str) else None)


async def _ota_check(ota_url: str, device_id: str, client_id: str) -> dict[str, Any]:
    from simulator.stock_ota import stock_headers, system_info

    headers = stock_headers(device_id, client_id)
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            response = await http.post(
                ota_url, headers=headers, json=system_info(device_id, client_id)
            )
    except httpx.HTTPError as exc:
        raise VoiceTurnFailed(
            f"cannot reach the OTA endpoint {_no_query(ota_url)}: {exc}"
        ) from None
    if response.status_code != 200:
        raise VoiceTurnFailed(
            f"the OTA endpoint answered HTTP {response.status_code}: {response.text[:200]}"
        )
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise VoiceTurnFailed("the OTA answer is not a JSON object")
    return answer


def _mqtt_link(link: VoiceLink, answer: dict[str, Any], device_id: str) -> VoiceLink:
    from backend.transports.mqtt_topics import device_key

    section = answer.get("mqtt")
    if not isinstance(section, dict) or not all(
        isinstance(section.get(name), str) for name in ("endpoint", "username", "password")
    ):
        raise VoiceTurnFailed("the OTA answer has no mqtt section: is MQTT on at the bridge?")
    suffix = f"/{device_key(device_id)}/up"
    publish = str(section.get("publish_topic") or "")
    prefix = publish[: -len(suffix)] if publish.endswith(suffix) else link.topic_prefix
    return replace(
        link,
        url=f"mqtt://{section['endpoint']}",
        token=section["password"],
        username=section["username"],
        topic_prefix=prefix,
    )


def _no_query(url: str) -> str:
    """An enrollment URL without its code (it is a credential)."""
    return url.split("?", 1)[0]


# ---- the turn ----------------------------------------------------------------------------------


async def hold_turn(
    link: VoiceLink,
    device_id: str,
    clip: "Clip",
    options: TurnOptions,
    wav: Path,
    progress: Progress | None = None,
) -> SpokenTurn:
    """Enrol if needed, connect, speak `clip`, wait for the answer, save it to `wav`;
    `progress` is told each stage as it starts."""
    stage = progress or (lambda _text: None)
    client_id = str(uuid.uuid4())
    if link.ota_url:
        stage("enrolling through the OTA endpoint")
    link = await enrol(link, device_id, client_id)
    device = _voice_device(link, device_id, client_id, options)
    listed = _watch_tools_list(device)
    try:
        stage(f"connecting to {link.url}")
        await _connect(device, link)
        stage("waiting for the bridge to list the device's tools")
        # A bridge that never lists tools still answers questions: go on after the wait.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(listed.wait(), MCP_READY_TIMEOUT_S)
        reply = await _speak(device, clip, options, stage)
    finally:
        with contextlib.suppress(*_link_errors()):  # the turn is over either way
            await device.close()
    return _record(device, device_id, reply, wav)


def _voice_device(
    link: VoiceLink, device_id: str, client_id: str, options: TurnOptions
) -> "VoiceDevice":
    from simulator.voice_client import VoiceDevice

    if link.transport == "mqtt":
        return VoiceDevice.mqtt(
            link.url,
            device_id,
            link.token or "",
            username=link.username,
            client_id=client_id,
            topic_prefix=link.topic_prefix,
            subscribe=link.subscribe,
            audio_format=options.codec,
        )
    return VoiceDevice.websocket(
        link.url,
        link.token,
        device_id,
        client_id,
        version=options.protocol_version,
        audio_format=options.codec,
    )


def _watch_tools_list(device: "VoiceDevice") -> asyncio.Event:
    """An event set once the bridge has asked the device for its tools (it is then ready)."""
    listed = asyncio.Event()
    answer = device.mcp.handle

    def handle(request: Any) -> dict[str, Any] | None:
        if isinstance(request, dict) and request.get("method") == "tools/list":
            listed.set()
        return answer(request)

    device.mcp.handle = handle  # type: ignore[method-assign]
    return listed


def _link_errors() -> tuple[type[Exception], ...]:
    """What a broken link raises: a refused or closed WebSocket, a lost broker, a socket."""
    import aiomqtt
    from websockets.exceptions import WebSocketException

    return (WebSocketException, aiomqtt.MqttError, OSError)


async def _connect(device: "VoiceDevice", link: VoiceLink) -> None:
    from simulator.voice_client import VoiceClientError

    try:
        await device.connect()
    except VoiceClientError as exc:
        raise VoiceTurnFailed(f"the bridge did not greet the device: {exc}") from None
    except _link_errors() as exc:
        raise VoiceTurnFailed(f"cannot connect to {link.url}: {_describe(exc)}") from None


def _describe(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


async def _speak(
    device: "VoiceDevice", clip: "Clip", options: TurnOptions, stage: Progress
) -> "VoiceReply":
    """listen start, the speech in real time, listen stop (manual), the answer; stops early when
    the bridge alerts the device instead (no voice there)."""
    from simulator.voice_client import VoiceClientError

    trailing_ms = 0 if options.mode == "manual" else 900
    try:
        await device.listen_start(options.mode)
        stage(f"speaking ({clip.duration_ms / 1000:.1f} s of speech)")
        await _unless_alerted(device, device.send_speech(clip, trailing_silence_ms=trailing_ms))
        if options.mode == "manual":
            await device.listen_stop()
        stage(f"waiting for the spoken answer (up to {options.answer_timeout_s:g} s)")
        return await _unless_alerted(device, device.wait_turn(options.answer_timeout_s))
    except VoiceClientError as exc:
        raise VoiceTurnFailed(f"no spoken answer: {exc}") from None
    except _link_errors() as exc:
        raise VoiceTurnFailed(f"the link to the bridge failed: {_describe(exc)}") from None


async def _unless_alerted(device: "VoiceDevice", work: Awaitable[T]) -> T:
    """`work`'s result, or VoiceTurnFailed as soon as the device receives an `alert`."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            alert = _first_alert(device)
            if alert is not None:
                raise VoiceTurnFailed(_alert_message(alert))
            await asyncio.wait({task}, timeout=ALERT_CHECK_S)
        return task.result()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _first_alert(device: "VoiceDevice") -> dict[str, Any] | None:
    return next((m for _, m in device.events if m.get("type") == "alert"), None)


def _alert_message(alert: dict[str, Any]) -> str:
    status, message = alert.get("status"), alert.get("message")
    if status == VOICE_UNAVAILABLE:
        return f"the bridge cannot answer by voice: {message}"
    return f"the bridge sent an alert instead of an answer: {status}: {message}"


def _record(device: "VoiceDevice", device_id: str, reply: "VoiceReply", wav: Path) -> SpokenTurn:
    wav.parent.mkdir(parents=True, exist_ok=True)
    device.save_wav(wav)
    device.save_events(events_path(wav))
    return SpokenTurn(
        device_id=device_id,
        transcript=reply.transcript,
        sentences=reply.sentences,
        tool_calls=list(device.mcp.calls),
        answer_ms=reply.heard.duration_ms,
        wav=wav,
        events=events_path(wav),
    )


# ---- output ------------------------------------------------------------------------------------


def print_turn(turn: SpokenTurn, console: Console) -> None:
    """The transcript, the tool calls, the answer's sentences and where the audio went."""

    def say(text: str) -> None:
        console.print(text, highlight=False, markup=False, soft_wrap=True)

    heard = turn.transcript if turn.transcript else "(nothing recognized)"
    say(f"transcript: {heard}")
    for name, arguments in turn.tool_calls:
        say(f"tool call: {name} {json.dumps(arguments, separators=(',', ':'))}")
    say(f"answer: {' '.join(turn.sentences) or '(no sentence)'}")
    say(f"answer audio: {turn.answer_ms / 1000:.1f} s saved to {turn.wav}")
    say(f"events: {turn.events}")


async def run_voice_turn(
    link: VoiceLink,
    device_id: str,
    clip: "Clip",
    options: TurnOptions,
    wav: Path,
    console: Console,
    err: Console | None = None,
) -> SpokenTurn:
    """`simulate --say/--speak`: hold the turn and print it; while it lasts (up to half a minute
    and more), what it waits for goes to `err` (stderr: stdout keeps the turn only)."""
    where = "the bridge (URL and token from its OTA endpoint)" if link.ota_url else link.url
    console.print(
        f"voice device {device_id} ({options.codec}, {options.mode} mode) speaking "
        f"{clip.duration_ms / 1000:.1f} s to {where}",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    async with waiting(err, clip, options) as progress:
        turn = await hold_turn(link, device_id, clip, options, wav, progress)
    print_turn(turn, console)
    return turn


# How often the spinner's elapsed seconds move.
TICK_S = 0.5


@contextlib.asynccontextmanager
async def waiting(
    err: Console | None, clip: "Clip", options: TurnOptions
) -> AsyncIterator[Progress]:
    """Progress on `err` while a turn is held: on a terminal a spinner with the stage and the
    seconds spent (gone when the turn ends); elsewhere (a log, a pipe) one `waiting for` line."""
    if err is None:
        yield lambda _text: None
        return
    if not err.is_terminal:
        err.print(
            f"waiting for the spoken answer: {clip.duration_ms / 1000:.1f} s of speech, then up "
            f"to {options.answer_timeout_s:g} s for the answer",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        yield lambda _text: None
        return
    started = time.monotonic()
    stage = "starting"
    with err.status(stage) as status:

        def show() -> None:
            status.update(Text(f"{stage} ({time.monotonic() - started:.0f} s)"))

        def told(text: str) -> None:
            nonlocal stage
            stage = text
            show()

        async def tick() -> None:
            while True:
                await asyncio.sleep(TICK_S)
                show()

        ticker = asyncio.create_task(tick())
        try:
            yield told
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)


# ---- where the device goes ---------------------------------------------------------------------


def link_from_settings(
    settings: "Settings",
    transport: Transport,
    device_id: str,
    *,
    url: str | None = None,
    token: str | None = None,
    mqtt: str | None = None,
    stock: bool = False,
    ota: str | None = None,
) -> VoiceLink:
    """What `simulate` would use for one device: the given URL/token/broker/OTA, else the local
    bridge's (an enrollment code made through its admin API when it has per-device tokens)."""
    from backend.cli.local import device_auth_mode, device_endpoint, device_token
    from backend.cli.runs import enrollment_url, simulator_mqtt

    per_device = device_auth_mode(settings) == "device"
    if transport == "mqtt":
        if ota is None and mqtt is None and per_device:
            ota = enrollment_url(settings, 1, "mqtt")
        if ota is not None:
            return VoiceLink("mqtt", ota_url=ota, subscribe=not stock)
        broker, options = simulator_mqtt(settings, mqtt, stock)
        return VoiceLink(
            "mqtt",
            broker,
            options.password(device_id),
            topic_prefix=options.topic_prefix,
            subscribe=not stock,
        )
    no_credentials = token is None and url is None and device_token(settings) is None
    if ota is None and no_credentials and per_device:
        ota = enrollment_url(settings, 1)
    if ota is not None:
        return VoiceLink("ws", ota_url=ota)
    url, token = device_endpoint(settings, url, token)
    return VoiceLink("ws", url, token)


def device_id_for(index: int) -> str:
    """The simulated device id of `index` (the fleet's numbering)."""
    from simulator.fleet import device_id_for as fleet_device_id

    return fleet_device_id(index)
