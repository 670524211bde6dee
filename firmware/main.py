"""Device entry point: config -> HAL -> Wi-Fi -> MCP server + app, then serve forever.

With `ota_url` in the config (instead of `url` and `token`) the device asks the bridge's OTA
endpoint at every boot where to connect and with which token, activating itself first if the
bridge does not know it yet, and installs a newer firmware bundle when one is offered
(lib/ota.py); it then reboots (the ESP32) or exits with status 3 (a host, to be restarted). The
answer also chooses the transport: a `websocket` section, or an `mqtt` one with the broker login
(the operator's choice per device; MQTT needs micropython-lib's umqtt.simple in /lib).

On the ESP32 it runs after boot.py with config.json beside it. On the MicroPython unix port:
`micropython firmware/main.py path/to/config.json`; there is no `network` module, so the fake
HAL is used and its state changes are printed (`[hal] volume = 42`). Lines typed on the console
are sent to the bridge as text input.

A missing or broken config prints one message and then idles (ESP32: no crash or reboot loop)
or exits with status 2 (unix port).
"""

import sys

FIRMWARE_VERSION = "0.1.0"
DEFAULT_BOARD_NAME = "esp32-mcp-bridge"
EXIT_BAD_CONFIG = 2
EXIT_UPDATED = 3
CLIENT_ID_FILE = "client_id"
WIFI_RETRY_S = 30


def _here() -> str:
    path = globals().get("__file__") or "main.py"
    cut = path.rfind("/")
    return path[:cut] if cut > 0 else "."


# On the device /lib is already on sys.path; on a host checkout firmware/lib sits beside us.
sys.path.append(_here() + "/lib")

import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import ota  # noqa: E402
import tools_stock  # noqa: E402
from app import App, console_input  # noqa: E402
from compat import MICROPYTHON  # noqa: E402
from mcp_server import McpServer  # noqa: E402
from transport_ws import WsTransport, parse_url  # noqa: E402


class ConfigError(Exception):
    pass


# ---- config ------------------------------------------------------------------------------------


def config_path() -> str:
    argv = getattr(sys, "argv", None) or []
    return argv[1] if len(argv) > 1 else "config.json"


def load_config(path) -> dict:
    try:
        with open(path) as file:
            config = json.load(file)
    except OSError:
        raise ConfigError(path + " not found: copy config.example.json to config.json and edit it")
    except ValueError as error:
        raise ConfigError(path + " is not valid JSON (" + str(error) + ")")
    check_config(config)
    return config


def check_config(config):
    if not isinstance(config, dict):
        raise ConfigError("config must be a JSON object")
    transport = config.get("transport", "ws")
    if transport not in ("ws", "mqtt"):
        raise ConfigError('"transport" ' + repr(transport) + ' is not supported: "ws" or "mqtt"')
    ota_url = config.get("ota_url")
    if transport == "mqtt" and (ota_url is None or config.get("mqtt") is not None):
        check_mqtt_config(config.get("mqtt"), ota_url is None)
    if ota_url is not None:
        try:
            ota.parse_http_url(ota_url)
        except ValueError as error:
            raise ConfigError('"ota_url": ' + str(error))
    url = config.get("url")
    if transport == "ws" and ota_url is None and (not isinstance(url, str) or not url):
        raise ConfigError(
            '"ota_url" (e.g. "http://192.168.1.10:8002/xiaozhi/ota/") or "url" (e.g. '
            '"ws://192.168.1.10:8000/xiaozhi/v1/") is missing'
        )
    if transport == "ws" and url is not None:
        try:
            parse_url(url)
        except ValueError as error:
            raise ConfigError('"url": ' + str(error))
    if config.get("hal", "esp32") not in ("esp32", "fake"):
        raise ConfigError('"hal" must be "esp32" or "fake"')
    for key in ("token", "device_id", "client_id", "ssid", "password", "board_name"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ConfigError('"' + key + '" must be a string')
    if not isinstance(config.get("pins", {}), dict):
        raise ConfigError('"pins" must be an object like {"led": 2}')
    check_voice_config(config.get("voice"), config.get("audio"))


def check_voice_config(voice, audio):
    """The "voice" object (mode, queue_frames) and the fake HAL's "audio" object."""
    if voice is not None:
        if not isinstance(voice, dict):
            raise ConfigError('"voice" must be an object like {"mode": "auto"}')
        if voice.get("mode", "auto") not in ("auto", "manual", "realtime", "off"):
            raise ConfigError('"voice.mode" must be "auto", "manual", "realtime" or "off"')
        frames = voice.get("queue_frames", 40)
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            raise ConfigError('"voice.queue_frames" must be a positive number of frames')
    if audio is not None and not isinstance(audio, dict):
        raise ConfigError('"audio" must be an object like {"mic_wav": "question.wav"}')


def check_mqtt_config(mqtt, needs_url=True):
    """The "mqtt" object of a `"transport": "mqtt"` config (docs/mqtt.md); with an `ota_url` the
    broker URL and login come from the OTA answer, so the object only tunes them."""
    from transport_mqtt import parse_url as parse_mqtt_url

    if not isinstance(mqtt, dict):
        raise ConfigError('"mqtt" must be an object like {"url": "mqtt://192.168.1.10:1883", ...}')
    if needs_url or mqtt.get("url") is not None:
        try:
            parse_mqtt_url(mqtt.get("url"))
        except ValueError as error:
            raise ConfigError('"mqtt.url": ' + str(error))
    for key in ("username", "password", "client_id", "topic_prefix", "publish_topic"):
        if mqtt.get(key) is not None and not isinstance(mqtt[key], str):
            raise ConfigError('"mqtt.' + key + '" must be a string')
    if mqtt.get("keepalive") is not None and not isinstance(mqtt["keepalive"], int):
        raise ConfigError('"mqtt.keepalive" must be a number of seconds')


def bad_config(message):
    """Say it once; exit on a host, idle on the device (a reset would only repeat the error)."""
    print("config error: " + message)
    if sys.platform in ("linux", "darwin", "win32"):
        sys.exit(EXIT_BAD_CONFIG)
    import time

    while True:
        time.sleep(3600)


# ---- identity ----------------------------------------------------------------------------------


def stored_client_id(directory) -> str:
    """A UUIDv4 generated once and kept in a file (stock keeps it in NVS)."""
    path = directory + "/" + CLIENT_ID_FILE
    try:
        with open(path) as file:
            client_id = file.read().strip()
        if len(client_id) == 36:
            return client_id
    except OSError:
        pass
    client_id = new_uuid4()
    try:
        with open(path, "w") as file:
            file.write(client_id)
    except OSError as error:
        print("note: could not save the client id to " + path + ": " + str(error))
    return client_id


def new_uuid4() -> str:
    from binascii import hexlify

    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    text = hexlify(bytes(raw)).decode()
    return text[:8] + "-" + text[8:12] + "-" + text[12:16] + "-" + text[16:20] + "-" + text[20:]


def host_mac(client_id) -> str:
    """A stable, locally administered MAC for a board without Wi-Fi, derived from client_id."""
    from hashlib import sha1

    digest = sha1(client_id.encode()).digest()
    return "02:" + ":".join("%02x" % byte for byte in digest[:5])


# ---- hardware ----------------------------------------------------------------------------------


def print_change(what, value):
    if what == "show":
        print("[" + value[0] + "] " + value[1])
    elif isinstance(value, (dict, list, tuple)):
        print("[hal] " + what + " = " + json.dumps(value, separators=(",", ":")))
    else:
        print("[hal] " + what + " = " + str(value))


def esp32_hal_module():
    """hal_esp32 where machine and network exist, else None (unix port, CPython)."""
    try:
        import hal_esp32

        return hal_esp32
    except ImportError:
        return None


async def make_hal(config, client_id):
    """(hal, device_id); joins Wi-Fi first on the real hardware."""
    board_name = config.get("board_name") or DEFAULT_BOARD_NAME
    version = ota.stored_version(_here(), FIRMWARE_VERSION)
    hal_esp32 = esp32_hal_module() if config.get("hal", "esp32") == "esp32" else None
    if hal_esp32 is None:
        if config.get("hal") != "fake":
            print("no machine/network modules here: using the fake HAL")
        import hal_fake

        device_id = config.get("device_id") or host_mac(client_id)
        hal = hal_fake.HalFake(
            board_name=board_name,
            firmware_version=version,
            on_change=print_change,
            mac=device_id,
            client_id=client_id,
            audio=config.get("audio"),
        )
        return hal, device_id
    if not config.get("ssid"):
        bad_config('"ssid" is missing: the ESP32 needs Wi-Fi (or set "hal": "fake")')
    try:
        hal = hal_esp32.HalEsp32(config.get("pins") or {}, client_id, board_name, version)
    except (ValueError, TypeError) as error:  # e.g. a pin number the chip does not have
        bad_config('"pins": ' + str(error))
        raise
    while not await hal_esp32.connect_wifi(config["ssid"], config.get("password") or ""):
        print("wifi: still not connected; next try in %d s" % WIFI_RETRY_S)
        await asyncio.sleep(WIFI_RETRY_S)
    return hal, config.get("device_id") or hal.mac


# ---- main --------------------------------------------------------------------------------------


async def main(config, path):
    directory = path[: path.rfind("/")] if "/" in path else "."
    client_id = config.get("client_id") or stored_client_id(directory)
    hal, device_id = await make_hal(config, client_id)
    url, token = config.get("url"), config.get("token") or ""
    mqtt = config.get("mqtt") if config.get("transport") == "mqtt" else None
    if config.get("ota_url"):
        answer = await from_ota(config["ota_url"], hal, device_id, client_id)
        mqtt = ota.mqtt_settings(answer, config.get("mqtt")) if "mqtt" in answer else None
        if mqtt is None:
            url, token = ota.websocket_endpoint(answer)
    server = McpServer(hal.board_name, hal.firmware_version)
    tools_stock.register(server, hal)
    app_config = {
        "url": mqtt["url"] if mqtt else url,
        "token": token,
        "device_id": device_id,
        "client_id": client_id,
        "protocol_version": config.get("protocol_version") or 1,
        "reconnect_min_s": config.get("reconnect_min_s", 1),
        "reconnect_max_s": config.get("reconnect_max_s", 30),
        "voice": config.get("voice"),
    }
    print("device " + device_id + " (client " + client_id + ") -> " + app_config["url"])
    if mqtt:
        app = mqtt_app(mqtt, app_config, hal, server, device_id, client_id)
    else:
        app = App(app_config, hal, server, WsTransport, log=print)
    if MICROPYTHON:  # CPython has no StreamReader over sys.stdin; the simulator types no text
        asyncio.create_task(console_input(app, asyncio.StreamReader(sys.stdin)))
    await app.run()


def mqtt_app(mqtt, app_config, hal, server, device_id, client_id):
    """The app over MQTT + UDP (needs micropython-lib's umqtt.simple in /lib)."""
    from app_mqtt import MqttApp
    from transport_mqtt import MqttTransport, umqtt_installed

    if not umqtt_installed():
        bad_config("MQTT needs umqtt.simple in /lib: `mpremote mip install umqtt.simple`")

    def connect(url, headers):
        return MqttTransport(mqtt, device_id, client_id, log=print)

    return MqttApp(app_config, hal, server, connect, log=print)


async def from_ota(ota_url, hal, device_id, client_id):
    """The OTA answer with this device's login; a newer firmware bundle is installed first."""
    answer = await ota.provision(ota_url, hal, device_id, client_id, log=print)
    update = ota.offered_update(answer, hal.firmware_version)
    if update is not None:
        print("ota: firmware " + str(update["version"]) + " offered; downloading")
        try:
            await ota.apply_bundle(update["url"], _here(), update.get("sha256"), log=print)
        except Exception as error:  # a failed update keeps the running firmware
            print("ota: update failed: " + str(error))
        else:
            hal.reboot()
            print("ota: updated; restarting")
            sys.exit(EXIT_UPDATED)  # the ESP32 has reset already; a host run ends here
    return answer


def start():
    path = config_path()
    try:
        config = load_config(path)
    except ConfigError as error:
        bad_config(str(error))
        return
    asyncio.run(main(config, path))


if __name__ == "__main__":
    start()
