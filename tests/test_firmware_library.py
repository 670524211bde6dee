"""backend.firmware as a library: where it finds the firmware (source checkout and installed
wheel), what it raises, the command lines it builds, and the layering rules it exists for."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from backend.errors import BridgeError
from backend.firmware import FirmwareError, firmware_dir, micropython_argv, source
from backend.firmware.build import build
from backend.firmware.deploy import deploy_command, plan_deploy
from backend.firmware.errors import (
    DeviceConfigError,
    ImageError,
    SourceNotFound,
    ToolNotFound,
    UsageError,
)
from backend.firmware.flash import check_image, flash_commands

REPO = Path(__file__).resolve().parents[1]


# ---- where the firmware is -----------------------------------------------------------------------


def test_a_source_checkout_finds_firmware_beside_backend() -> None:
    assert firmware_dir() == REPO / "firmware"
    assert (firmware_dir() / "lib" / "mcp_server.py").is_file()


def _fake_firmware(folder: Path) -> Path:
    (folder / "lib").mkdir(parents=True)
    (folder / "lib" / "mcp_server.py").write_text("")
    (folder / "main.py").write_text("")
    return folder


def test_the_packaged_copy_wins_and_a_half_folder_is_no_candidate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged, checkout = tmp_path / "packaged", _fake_firmware(tmp_path / "checkout")
    monkeypatch.setattr(source, "PACKAGED", packaged)
    monkeypatch.setattr(source, "CHECKOUT", checkout)
    (packaged / "lib").mkdir(parents=True)  # lib/ without mcp_server.py: not a firmware folder
    assert firmware_dir() == checkout

    (packaged / "lib" / "mcp_server.py").write_text("")
    (packaged / "main.py").write_text("")
    assert firmware_dir() == packaged


def test_no_firmware_anywhere_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source, "PACKAGED", tmp_path / "a")
    monkeypatch.setattr(source, "CHECKOUT", tmp_path / "b")

    with pytest.raises(SourceNotFound) as raised:
        firmware_dir()
    assert "\n" not in str(raised.value) and "firmware sources not found" in str(raised.value)


def test_an_installed_wheel_carries_the_firmware_and_finds_it(tmp_path: Path) -> None:
    # The PEP 517 hook that `pip wheel` calls, without pip's start-up and build isolation.
    built = subprocess.run(
        [sys.executable, "-c", f"import hatchling.build as b; b.build_wheel({str(tmp_path)!r})"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("esp32_mcp_bridge-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(site)
    packaged = sorted(name for name in names if name.startswith("backend/firmware/_firmware/"))
    assert "backend/firmware/_firmware/lib/mcp_server.py" in packaged
    assert "backend/firmware/_firmware/main.py" in packaged
    # Only what a device runs: never a local config.json (secrets) or the pyright stubs.
    assert all("/typings/" not in name and not name.endswith("/config.json") for name in names)

    # -S: no site-packages, so neither this checkout (editable install) nor any dependency.
    probe = (
        f"import sys; sys.path.insert(0, {str(site)!r}); "
        "from backend.firmware import firmware_dir; print(firmware_dir())"
    )
    found = subprocess.run(
        [sys.executable, "-S", "-c", probe], cwd=tmp_path, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == site / "backend" / "firmware" / "_firmware"


# ---- errors and command lines --------------------------------------------------------------------


def test_errors_are_bridge_errors_with_one_line_and_an_exit_code(tmp_path: Path) -> None:
    with pytest.raises(ImageError) as raised:
        check_image(tmp_path / "missing.bin")
    assert isinstance(raised.value, FirmwareError) and isinstance(raised.value, BridgeError)
    assert str(raised.value) == f"image file {tmp_path / 'missing.bin'} not found"
    assert raised.value.exit_code == 1

    with pytest.raises(UsageError) as usage:
        build(None, tmp_path / "out", "arm64")
    assert usage.value.exit_code == 2
    assert not (tmp_path / "out").exists()


def test_checks_come_before_anything_runs(tmp_path: Path) -> None:
    bad = tmp_path / "c.json"
    bad.write_text('{"url": "wss://x.example/"}')
    with pytest.raises(DeviceConfigError, match=r'"url": TLS not supported'):
        plan_deploy("/dev/null", bad, tmp_path / "out")

    good = tmp_path / "good.json"
    good.write_text('{"url": "ws://10.0.0.2:8000/x/", "token": "t", "ssid": "s"}')
    with pytest.raises(UsageError, match="--dest must be a board path"):
        plan_deploy("/dev/null", good, tmp_path / "out", "board")
    assert not (tmp_path / "out").exists()


def test_a_missing_micropython_is_tool_not_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))

    with pytest.raises(ToolNotFound, match="micropython not found: install the firmware tools"):
        micropython_argv(Path("main.py"))


def test_command_lines(tmp_path: Path) -> None:
    out, config = tmp_path / "out", Path("my.json")
    out.mkdir()
    (out / "main.py").write_text("")  # entry files are copied when the build has them
    assert deploy_command("mpremote", "/dev/ttyUSB0", out, config, ":.", True, False) == [
        *("mpremote", "connect", "/dev/ttyUSB0", "resume"),
        *("cp", "-r", f"{out}/lib", ":."),
        *("+", "cp", f"{out}/main.py", ":."),
        *("+", "cp", "my.json", ":./config.json"),
    ]
    assert deploy_command("mpremote", "a0", out, config)[-4:] == [
        *("my.json", ":config.json"),
        *("+", "reset"),
    ]
    assert flash_commands("esptool", "esp32s3", "COM3", 115200, Path("mp.bin"), False) == [
        [
            *("esptool", "--chip", "esp32s3", "--port", "COM3", "--baud", "115200"),
            *("write-flash", "-z", "0x0", "mp.bin"),
        ]
    ]
    with pytest.raises(UsageError, match="unknown --chip 'esp8266'"):
        flash_commands("esptool", "esp8266", "COM3", 115200, Path("mp.bin"))


# ---- layering ------------------------------------------------------------------------------------

# The CLI is the one place in backend/ that starts simulated devices (demo, simulate).
ALLOWED = {
    "backend/cli/runs.py": {"simulator"},
    "backend/cli/voice.py": {"simulator"},  # simulate --say: the stock-style voice device
}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [("backend", {"simulator", "bench", "tests"}), ("tests", {"bench"})],
)
def test_layering(folder: str, forbidden: set[str]) -> None:
    offenders = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        bad = (_imported_packages(path) & forbidden) - ALLOWED.get(relative, set())
        if bad:
            offenders[relative] = sorted(bad)
    assert offenders == {}


def test_tests_share_helpers_not_each_other() -> None:
    """Shared test code lives in helpers/stock_device/fakes, never in a test module or conftest."""
    offenders = {}
    for path in sorted((REPO / "tests").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if (
                    parts[0] == "tests"
                    and len(parts) > 1
                    and (parts[1].startswith("test_") or parts[1] == "conftest")
                ):
                    offenders[path.name] = node.module
    assert offenders == {}
