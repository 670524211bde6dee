"""`esp32-bridge devices [...]`: list devices; activate, approve and revoke them.

`esp32-bridge devices` alone lists devices, as before. The subcommands manage who may connect
(docs/provisioning.md), through the admin API (scope admin):

- `pending`: activation requests waiting for the operator, with the code each device shows;
- `approve CODE|DEVICE`: give the device its own credentials (by the code it shows, or by its
  id when only one request is pending for it; with several candidates, only by code);
- `revoke DEVICE`: its token stops working and its live link is closed at once;
- `transport DEVICE websocket|mqtt|default`: what its next OTA answer hands it;
- `language DEVICE [auto|en|vi]`: the language its speech is heard in (no value: show it);
- `enroll`: a one-time (or N-time) enrollment code for fleets: a device whose OTA URL carries
  it is approved by itself;
- `serial-key SERIAL` / `serial-key SERIAL --remove`: the HMAC key of a device's eFuse serial;
- `mosquitto-passwd FILE`: a Mosquitto password file with every approved device's login.
"""

import os
import sys
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

import typer

from backend.cli.options import (
    ConfigOpt,
    DataDirOpt,
    JsonOpt,
    ServerOpt,
    TokenOpt,
    WideOpt,
    admin_client,
)
from backend.cli.output import Listing, fail, listing, print_json, say, show, when

devices_app = typer.Typer(
    help="List devices (no subcommand), or manage who may connect: pending, approve, revoke, "
    "enroll, ...",
    invoke_without_command=True,
)

TRANSPORTS = ("websocket", "mqtt")
VOICE_LANGUAGES = ("auto", "en", "vi")  # backend/voice/language.py


@devices_app.callback()
def list_devices(
    ctx: typer.Context,
    online: Annotated[
        bool | None,
        typer.Option("--online/--offline", help="Only connected (or only offline) devices."),
    ] = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """List devices: connected ones and those seen before (offline, with their last tools)."""
    if ctx.invoked_subcommand is not None:
        return
    with admin_client(server, token, data_dir, config) as admin:
        rows = admin.devices(online=online)
    if as_json:
        print_json(rows)
        return
    if rows:
        show(devices_table(rows, wide=wide))
    else:
        say("no devices" if online is None else f"no {'on' if online else 'off'}line devices")


def devices_table(rows: list[dict[str, Any]], *, wide: bool = False) -> Listing:
    """The `devices` table. In a cluster every row says which instance serves the device (`-`:
    offline); a single bridge's rows have no `instance`, and the table no such column."""
    clustered = any("instance" in device for device in rows)
    columns = ("device_id", "state", "transport", "tools", "server", "connected_at", "last_seen")
    table = listing(
        *columns, *(("instance",) if clustered else ()), ids=("device_id", "instance"), wide=wide
    )
    for device in rows:
        info = device.get("server_info") or {}
        ota = device.get("ota") or {}
        server_text = " ".join(str(info.get(k, "")) for k in ("name", "version")).strip()
        if not server_text:
            server_text = " ".join(
                str(ota.get(k, "")) for k in ("board_type", "firmware_version")
            ).strip()
        table.add_row(
            device["device_id"],
            device["state"],
            device["transport"],
            str(device["tool_count"]),
            server_text,
            when(device.get("connected_at")),
            when(device.get("last_seen")),
            *((device.get("instance") or "-",) if clustered else ()),
        )
    return table


@devices_app.command("pending")
def pending(
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Activation requests waiting for approval, with the code each device shows."""
    with admin_client(server, token, data_dir, config) as admin:
        rows = admin.get("/api/provisioning/pending")["pending"]
    if as_json:
        print_json(rows)
        return
    if not rows:
        say("no pending activations")
        return
    show(pending_table(rows, wide=wide))
    for device_id, claims in contested(rows).items():
        # Only the code on the device's screen tells the real device from a stranger with its MAC.
        say(
            f"{device_id}: {claims} candidates (different Client-Ids); approve the code "
            "the device shows: esp32-bridge devices approve CODE"
        )


def pending_table(rows: list[dict[str, Any]], *, wide: bool = False) -> Listing:
    """The `devices pending` table, a device's requests together, oldest first."""
    table = listing(
        "code", "device_id", "claims", "client_id", "board", "firmware", "serial", "from", "since",
        ids=("code", "device_id", "client_id"), wide=wide,
    )  # fmt: skip
    for row in sorted(rows, key=lambda r: (r["device_id"], r["created_at"])):
        serial = row["serial_number"] or ""
        if serial:
            serial += f" ({row['serial_check']})"
        claims = int(row.get("candidates") or 1)
        table.add_row(
            row["code"],
            row["device_id"],
            f"1 of {claims}" if claims > 1 else "",
            row["client_id"],
            row["board"] or "",
            row["firmware"] or "",
            serial,
            row["remote"] or "",
            when(row["created_at"]),
        )
    return table


def contested(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The devices with several pending requests (different Client-Ids): how many."""
    return {
        row["device_id"]: int(row.get("candidates") or 1)
        for row in rows
        if int(row.get("candidates") or 1) > 1
    }


@devices_app.command("approve")
def approve(
    target: Annotated[
        str,
        typer.Argument(
            metavar="CODE_OR_DEVICE", help="The code the device shows, or its device id."
        ),
    ],
    transport: Annotated[
        str | None,
        typer.Option(
            "--transport",
            metavar="TRANSPORT",
            help="websocket or mqtt (default: the bridge's setting).",
        ),
    ] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Approve a device: its next OTA check hands it its own credentials."""
    if transport is not None and transport not in TRANSPORTS:
        raise fail("--transport is websocket or mqtt", 2)
    body: dict[str, Any] = {"target": target}
    if transport is not None:
        body["transport"] = transport
    with admin_client(server, token, data_dir, config) as admin:
        device = admin.post("/api/provisioning/approve", body)
    say(
        f"approved {device['device_id']} (client {device['client_id']}); "
        "it gets its credentials at its next OTA check"
    )


@devices_app.command("revoke")
def revoke(
    device: Annotated[str, typer.Argument(metavar="DEVICE", help="Device id.")],
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Revoke a device's credentials; a connected device is disconnected at once."""
    with admin_client(server, token, data_dir, config) as admin:
        revoked = admin.post(f"/api/provisioning/devices/{quote(device, safe='')}/revoke")
    say(f"revoked {revoked['device_id']}")


@devices_app.command("transport")
def set_transport(
    device: Annotated[str, typer.Argument(metavar="DEVICE", help="Device id.")],
    transport: Annotated[
        str, typer.Argument(metavar="TRANSPORT", help="websocket, mqtt or default.")
    ],
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Choose what the device's next OTA answer gives it: WebSocket or MQTT credentials."""
    if transport not in (*TRANSPORTS, "default"):
        raise fail("transport is websocket, mqtt or default", 2)
    value = None if transport == "default" else transport
    path = f"/api/provisioning/devices/{quote(device, safe='')}/transport"
    with admin_client(server, token, data_dir, config) as admin:
        admin.put(path, {"transport": value})
    say(f"{device}: transport {transport}")


@devices_app.command("language")
def voice_language(
    device: Annotated[str, typer.Argument(metavar="DEVICE", help="Device id.")],
    language: Annotated[
        str | None,
        typer.Argument(
            metavar="LANGUAGE", help="auto (its last turns' language), en or vi; none: show it."
        ),
    ] = None,
    as_json: JsonOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Show or set the language the device's speech is heard in (setting it needs admin)."""
    if language is not None and language not in VOICE_LANGUAGES:
        raise fail("language is auto, en or vi", 2)
    path = f"/api/devices/{quote(device, safe='')}/voice"
    with admin_client(server, token, data_dir, config) as admin:
        body = None if language is None else {"language": language}
        voice = admin.get(path) if body is None else admin.put(path, body)
    if as_json:
        print_json(voice)
        return
    heard = ", ".join(voice["languages_available"])
    say(f"{voice['device_id']}: language {voice['language']}, heard in {voice['effective']}")
    say(f"this bridge hears: {heard}")


@devices_app.command("enroll")
def enroll(
    name: Annotated[
        str, typer.Option("--name", metavar="NAME", help="What the code is for.")
    ] = "enrollment",
    uses: Annotated[
        int,
        typer.Option(
            "--uses", metavar="N", min=1, help="How many devices it may enrol (1 or more)."
        ),
    ] = 1,
    ttl: Annotated[
        float,
        typer.Option(
            "--ttl", metavar="SECONDS", min=1, help="Seconds until it expires (at least 1)."
        ),
    ] = 3600.0,
    transport: Annotated[
        str | None, typer.Option("--transport", metavar="TRANSPORT", help="websocket or mqtt.")
    ] = None,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Create an enrollment code: a device whose OTA URL carries it is approved by itself."""
    if transport is not None and transport not in TRANSPORTS:
        raise fail("--transport is websocket or mqtt", 2)
    body: dict[str, Any] = {"name": name, "uses": uses, "ttl_s": ttl}
    if transport is not None:
        body["transport"] = transport
    with admin_client(server, token, data_dir, config) as admin:
        created = admin.post("/api/provisioning/enrollment-codes", body)
    say(f"enrollment code {created['id']}: {uses} use(s), expires {created['expires_at']}")
    say("OTA URL for the devices (shown once):")
    say(created["ota_url"])


@devices_app.command("serial-key")
def serial_key(
    serial: Annotated[
        str, typer.Argument(metavar="SERIAL", help="The device's eFuse serial number.")
    ],
    key_file: Annotated[
        Path | None,
        typer.Option(
            "--key-file", metavar="FILE", help="File with the key in hex (default: read stdin)."
        ),
    ] = None,
    remove: Annotated[bool, typer.Option("--remove", help="Forget the key.")] = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Register the HMAC key of a serial number (§5.3 activation challenge), or remove it.
    The key is read from a file or stdin, never from the command line."""
    path = f"/api/provisioning/serial-keys/{quote(serial, safe='')}"
    with admin_client(server, token, data_dir, config) as admin:
        if remove:
            admin.delete(path)
            say(f"removed the key of {serial}")
            return
        key = (key_file.read_text() if key_file is not None else sys.stdin.read()).strip()
        admin.put(path, {"key": key})
    say(f"registered the key of {serial}")


@devices_app.command("mosquitto-passwd")
def mosquitto_passwd(
    out: Annotated[
        Path, typer.Argument(metavar="FILE", help="The password_file to write (mode 0600).")
    ],
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
    config: ConfigOpt = None,
) -> None:
    """Write a Mosquitto password file with every approved device's broker login
    (username = device key, password = its token, stored as PBKDF2 hashes)."""
    with admin_client(server, token, data_dir, config) as admin:
        text = admin.text("/api/provisioning/mosquitto-passwd")
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    out.chmod(0o600)
    say(f"wrote {len(text.splitlines())} device logins to {out}")
