"""Our firmware and the OTA endpoint: firmware/main.py on the MicroPython unix port boots with
only an OTA URL, shows its activation code, is approved and connects with its own token; it
updates its files from a bundle the operator published (and does not loop); the bundle writer
(firmware/lib/ota.py) installs nothing unless every byte checks out."""

import asyncio
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.firmware import micropython_lib
from backend.firmware.build import build
from backend.provisioning.bundle import make_bundle, read_manifest
from backend.server import Bridge
from simulator.firmware import firmware_module
from testkit.processes import WatchedProcess
from testkit.settings import ADMIN_TOKEN
from tests.firmware_helpers import needs_micropython
from tests.helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
BOARD = "ota-board"
WAIT_S = 30.0
CODE_LINE = re.compile(r"^ota: activation code (\d{6}): approve it on the bridge$")


def copy_firmware(target: Path) -> Path:
    """A copy of firmware/ (main.py, boot.py, lib/*.py) that an update may rewrite."""
    source = REPO / "firmware"
    target.mkdir(parents=True)
    shutil.copytree(source / "lib", target / "lib")
    for name in ("main.py", "boot.py"):
        shutil.copy2(source / name, target / name)
    return target


def ota_config(directory: Path, ota_url: str) -> Path:
    path = directory / "config.json"
    path.write_text(
        json.dumps(
            {
                "ota_url": ota_url,
                "hal": "fake",
                "board_name": BOARD,
                "reconnect_min_s": 0.05,
                "reconnect_max_s": 0.5,
            }
        )
    )
    return path


def firmware_process(firmware: Path, config: Path, *libs: Path) -> WatchedProcess:
    from backend.firmware import micropython_argv, micropython_env

    return WatchedProcess(
        micropython_argv(firmware / "main.py", str(config)),
        micropython_env(firmware / "lib", *libs),
    )


def admin(bridge: Bridge) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    return httpx.AsyncClient(base_url=bridge.api_url, headers=headers, timeout=WAIT_S)


async def wait_until(check: Callable[[], Any], what: str) -> Any:
    async with asyncio.timeout(WAIT_S):
        while not (value := check()):  # noqa: ASYNC110 - a process's output has no event
            await asyncio.sleep(0.05)
    assert value, what
    return value


# ---- on the MicroPython unix port ----------------------------------------------------------------


@pytest.mark.micropython
@needs_micropython
async def test_firmware_boots_with_only_an_ota_url_is_approved_and_connects(
    bridge_factory: Callable[..., Any], tmp_path: Path
) -> None:
    bridge: Bridge = await bridge_factory(device_auth="device")
    config = ota_config(tmp_path, bridge.provisioning.ota_url)
    process = firmware_process(REPO / "firmware", config)
    await process.start()
    try:
        line = await wait_until(
            lambda: next((m for line in process.lines if (m := CODE_LINE.match(line))), None),
            "the activation code on the console",
        )
        code = line.group(1)
        [pending] = bridge.provisioning.store.pending()
        assert pending.code == code and pending.info["board_type"] == BOARD
        assert bridge.registry.get(pending.device_id) is None  # no token yet, no link
        async with admin(bridge) as api:
            approved = await api.post("/api/provisioning/approve", json={"target": code})
            assert approved.status_code == 200, approved.text
            device = await bridge.registry.wait_for_state(pending.device_id, timeout_s=WAIT_S)
            assert device.server_info is not None and device.server_info["name"] == BOARD
            called = await api.post(
                f"/api/devices/{pending.device_id}/tools/call",
                json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 33}},
            )
            assert called.status_code == 200 and called.json()["content"][0]["text"] == "true"
        assert any(line == "ota: activated" for line in process.lines)
        assert any(line == "[hal] volume = 33" for line in process.lines)
    finally:
        await process.stop()
        print("firmware output:\n" + process.output)


@pytest.mark.micropython
@needs_micropython
async def test_the_ota_answer_sends_the_firmware_to_mqtt_with_its_own_broker_login(
    bridge_factory: Callable[..., Any], tmp_path: Path
) -> None:
    """The operator chose MQTT for the device: the same config (only an OTA URL) brings it to the
    broker with the login and topics of the answer, and its tools are called over MQTT."""
    bridge: Bridge = await bridge_factory(
        device_auth="device",
        device_transport="mqtt",
        mqtt_url="embedded",
        mqtt_host="127.0.0.1",
        mqtt_port=0,
        udp_host="127.0.0.1",
        udp_port=0,
    )
    config = ota_config(tmp_path, bridge.provisioning.ota_url)
    process = firmware_process(REPO / "firmware", config, micropython_lib.ensure())
    await process.start()
    try:
        line = await wait_until(
            lambda: next((m for line in process.lines if (m := CODE_LINE.match(line))), None),
            "the activation code on the console",
        )
        async with admin(bridge) as api:
            approved = await api.post("/api/provisioning/approve", json={"target": line.group(1)})
            assert approved.status_code == 200, approved.text
            device_id = approved.json()["device_id"]
            device = await bridge.registry.wait_for_state(device_id, timeout_s=WAIT_S)
            assert device.transport == "mqtt"
            called = await api.post(
                f"/api/devices/{device_id}/tools/call",
                json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 44}},
            )
            assert called.status_code == 200 and called.json()["content"][0]["text"] == "true"
        assert bridge.mqtt is not None
        assert any(line.endswith("-> " + bridge.mqtt.device_url) for line in process.lines)
        assert any(line == "[hal] volume = 44" for line in process.lines)
    finally:
        await process.stop()
        print("firmware output:\n" + process.output)


@pytest.mark.micropython
@needs_micropython
async def test_firmware_installs_a_published_bundle_once_and_reports_its_version(
    bridge_factory: Callable[..., Any], tmp_path: Path
) -> None:
    bridge: Bridge = await bridge_factory(device_auth="device")
    firmware = copy_firmware(tmp_path / "device")
    # The new release: the same firmware with a marker in one module, as plain sources.
    source = copy_firmware(tmp_path / "source")
    marker = "# release 0.2.0 marker\n"
    (source / "lib" / "tools_stock.py").write_text(
        (source / "lib" / "tools_stock.py").read_text() + marker
    )
    build(source, tmp_path / "build", "none", compiled=False)
    bundle = tmp_path / "firmware-0.2.0.bundle"
    bundle.write_bytes(make_bundle(tmp_path / "build", "0.2.0"))
    status, out, err = await run_cli(
        "firmware", "publish", BOARD, "0.2.0", str(bundle),
        "--server", bridge.api_url, "--token", ADMIN_TOKEN,
    )  # fmt: skip
    assert status == 0 and "published ota-board 0.2.0" in out, err

    async with admin(bridge) as api:
        created = await api.post("/api/provisioning/enrollment-codes", json={"uses": 1})
        enroll_url = created.json()["ota_url"]
    config = ota_config(tmp_path, enroll_url)

    first = firmware_process(firmware, config)
    await first.start()
    try:
        code = await asyncio.wait_for(first.process.wait(), WAIT_S)
    finally:
        await first.stop()
        print("first boot:\n" + first.output)
    assert code == 3, first.output  # updated: "reboot"
    assert "ota: firmware 0.2.0 offered; downloading" in first.lines
    assert (firmware / "version").read_text() == "0.2.0"
    assert (firmware / "lib" / "tools_stock.py").read_text().endswith(marker)
    assert not list(firmware.rglob("*.new"))
    [release] = bridge.provisioning.releases.releases()
    assert release.downloads == 1

    second = firmware_process(firmware, config)
    await second.start()
    try:
        device_id = await wait_until(
            lambda: next(iter([d.device_id for d in bridge.registry]), None), "a connection"
        )
        device = await bridge.registry.wait_for_state(device_id, timeout_s=WAIT_S)
        assert device.server_info is not None and device.server_info["version"] == "0.2.0"
        record = bridge.registry.record(device_id)
        assert record is not None and record.ota is not None
        assert record.ota["firmware_version"] == "0.2.0"
    finally:
        await second.stop()
        print("second boot:\n" + second.output)
    assert not any("offered" in line for line in second.lines)  # no upgrade loop
    assert bridge.provisioning.releases.releases()[0].downloads == 1


# ---- the bundle writer on CPython ----------------------------------------------------------------


@pytest.fixture
def bundle_bytes(tmp_path: Path) -> bytes:
    build_dir = tmp_path / "build"
    (build_dir / "lib").mkdir(parents=True)
    (build_dir / "lib" / "a.mpy").write_bytes(b"A" * 3000)
    (build_dir / "main.py").write_text("print('new main')\n")
    (build_dir / "MANIFEST.json").write_text("{}")  # the build's own record is not shipped
    return make_bundle(build_dir, "1.2.0")


def install(root: Path, data: bytes, sha256: str | None, chunk: int = 700) -> str:
    ota = firmware_module("ota")
    writer = ota.BundleWriter(str(root))
    try:
        for start in range(0, len(data), chunk):
            writer.feed(data[start : start + chunk])
        version: str = writer.finish(sha256)
    except BaseException:
        writer.discard()
        raise
    return version


def old_firmware(root: Path) -> Path:
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "a.mpy").write_bytes(b"old")
    (root / "main.py").write_text("print('old main')\n")
    return root


def test_a_bundle_installs_every_file_and_its_version(tmp_path: Path, bundle_bytes: bytes) -> None:
    root = old_firmware(tmp_path / "fw")
    manifest = read_manifest(bundle_bytes)
    assert [entry[0] for entry in manifest["files"]] == ["lib/a.mpy", "main.py"]
    digest = hashlib.sha256(bundle_bytes).hexdigest()
    assert install(root, bundle_bytes, digest) == "1.2.0"
    assert (root / "lib" / "a.mpy").read_bytes() == b"A" * 3000
    assert (root / "main.py").read_text() == "print('new main')\n"
    assert (root / "version").read_text() == "1.2.0"
    assert not list(root.rglob("*.new"))


@pytest.mark.parametrize(
    "damage",
    ["wrong bundle sha256", "a flipped byte", "cut short", "a file the manifest lacks"],
)
def test_a_damaged_bundle_changes_nothing(tmp_path: Path, bundle_bytes: bytes, damage: str) -> None:
    ota = firmware_module("ota")
    root = old_firmware(tmp_path / "fw")
    data, digest = bundle_bytes, hashlib.sha256(bundle_bytes).hexdigest()
    if damage == "wrong bundle sha256":
        digest = "0" * 64
    elif damage == "a flipped byte":
        data = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
        digest = hashlib.sha256(data).hexdigest()
    elif damage == "cut short":
        data = data[:-10]
    else:
        data = data + b"extra"
    with pytest.raises(ota.OtaError):
        install(root, data, digest)
    assert (root / "lib" / "a.mpy").read_bytes() == b"old"
    assert (root / "main.py").read_text() == "print('old main')\n"
    assert not (root / "version").exists() and not list(root.rglob("*.new"))


def test_a_bundle_cannot_write_outside_the_firmware_folder(tmp_path: Path) -> None:
    ota = firmware_module("ota")
    evil = b"\n".join(
        [
            b"EMB1",
            json.dumps({"version": "1.0", "files": [["../escape.py", 1, "0" * 64]]}).encode(),
            b"x",
        ]
    )
    with pytest.raises(ota.OtaError, match="bad bundle entry"):
        install(old_firmware(tmp_path / "fw"), evil, None)
    assert not (tmp_path / "escape.py").exists()
