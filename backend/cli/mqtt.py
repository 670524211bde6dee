"""`esp32-bridge mqtt …`: what devices and external brokers need for the MQTT transport."""

import json
import uuid
from pathlib import Path
from typing import Annotated, Any

import typer

from backend.cli.local import cli_settings
from backend.cli.options import ConfigOpt
from backend.cli.output import console, fail
from backend.errors import BridgeError
from backend.transports.mqtt_credentials import (
    emqx_acl,
    emqx_auto_subscribe,
    mosquitto_acl,
    mosquitto_password_file,
)
from backend.transports.mqtt_topics import TopicScheme, build_client_id

mqtt_app = typer.Typer(help="MQTT + UDP transport: device credentials, broker files.")

DataDirOpt = Annotated[
    Path | None,
    typer.Option("--data-dir", metavar="DIR", help="Where the bridge keeps mqtt.secret."),
]


def credentials_record(settings: Any, device_id: str, created: list[Path]) -> dict[str, Any]:
    """Everything one device needs to log in, as printed by `mqtt credentials --json`."""
    from backend.transports.admission import normalize_device_id
    from backend.transports.mqtt_setup import device_credentials

    credential = device_credentials(settings, created).issue(normalize_device_id(device_id))
    scheme = TopicScheme(settings.mqtt_topic_prefix, settings.mqtt_shards)
    client_uuid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"esp32-mcp-bridge/{credential.username}"))
    return {
        "device_id": credential.device_id,
        "username": credential.username,
        "password": credential.password,
        "client_id": build_client_id(credential.device_id, client_uuid),
        "publish_topic": scheme.up(credential.username),
        "subscribe_topic": scheme.down(credential.username),
        "status_topic": scheme.status(credential.username),
        "topic_prefix": scheme.prefix,
        # What this repository's firmware builds its topics from: `<prefix>/s<shard>` sharded.
        "device_topic_prefix": scheme.device_prefix(credential.username),
        "shard": scheme.shard_of(credential.username),
    }


@mqtt_app.command("credentials")
def credentials(
    device: Annotated[
        str,
        typer.Argument(metavar="DEVICE", help="Device id, e.g. a4:cf:12:34:56:78."),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object, for scripts.")] = False,
    bridge_user: Annotated[
        str,
        typer.Option(
            "--bridge-user", metavar="NAME", help="The bridge's own username on the broker."
        ),
    ] = "bridge",
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Print a device's broker username/password and the Mosquitto and EMQX files for it.

    The password is derived from the bridge's credential secret (`mqtt_secret`, else
    `<data-dir>/mqtt.secret`, created when missing), so the bridge's embedded endpoint accepts it
    and it can be printed again at any time.
    """
    settings = cli_settings(config, data_dir=data_dir)
    created: list[Path] = []
    try:
        record = credentials_record(settings, device, created)
        prefix, shards = settings.mqtt_topic_prefix, settings.mqtt_shards
        acl = mosquitto_acl(prefix, bridge_user, shards=shards)
        password_line = mosquitto_password_file([(record["username"], record["password"])])
        emqx = emqx_acl(prefix, bridge_user, shards=shards)
        auto_subscribe = emqx_auto_subscribe(prefix, shards=shards)
    except BridgeError as exc:
        raise fail(str(exc), 2) from None
    for path in created:
        typer.echo(f"created secret file {path} (mode 0600)", err=True)
    if settings.device_auth == "device":
        typer.echo(
            'note: device_auth is "device" (the default): the embedded broker accepts only '
            "each device's own token, from its OTA answer; this derived password works only "
            'with device_auth = "shared" or on a broker you give this password file',
            err=True,
        )
    if as_json:
        typer.echo(json.dumps(record))
        return
    ota = {
        "endpoint": "<bridge host>:<mqtt port>",
        "client_id": record["client_id"],
        "username": record["username"],
        "password": record["password"],
        "keepalive": 240,
        "publish_topic": record["publish_topic"],
    }
    firmware = {
        "transport": "mqtt",
        "mqtt": {
            "url": "mqtt://<bridge host>:<mqtt port>",
            "username": record["username"],
            "password": record["password"],
            "topic_prefix": record["device_topic_prefix"],
        },
    }
    sections = [
        ("device", _fields(record)),
        ("this repository's firmware: config.json keys", json.dumps(firmware, indent=2)),
        ("stock firmware: the OTA answer's mqtt object", json.dumps(ota, indent=2)),
        (
            f"Mosquitto password_file line (the bridge's own: mosquitto_passwd FILE {bridge_user})",
            password_line.rstrip("\n"),
        ),
        ("Mosquitto acl_file (stock firmware needs the embedded broker or EMQX)", acl),
        ("EMQX 5 acl.conf", emqx),
        ("EMQX 5 auto_subscribe (gives stock firmware its downlink)", auto_subscribe),
    ]
    for title, body in sections:
        console.print(f"# {title}", style="bold", highlight=False, markup=False)
        console.print(body.rstrip("\n") + "\n", highlight=False, markup=False, soft_wrap=True)


def _fields(record: dict[str, Any]) -> str:
    names = ["device_id", "username", "password", "client_id", "publish_topic"]
    names += ["subscribe_topic", "status_topic"]
    return "\n".join(f"{name:<16}{record[name]}" for name in names)
