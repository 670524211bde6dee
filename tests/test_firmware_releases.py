"""Firmware an operator publishes is offered by the OTA endpoint only to devices of that board
on an older version (dot-separated integer compare), downloaded with Content-Length and a
SHA-256 that matches, and never offered in a loop."""

import hashlib
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN
from testkit.stock_device import CLIENT_ID
from tests.helpers import run_cli
from tests.storage_helpers import bridge_database_url

__all__ = ["bridge_database_url"]  # the fixture: releases are stored on both engines

BOARD = "bread-compact-wifi"
MAC = "a4:cf:12:34:56:78"


def headers(mac: str = MAC, board: str = BOARD, version: str = "2.4.2") -> dict[str, str]:
    return {"Device-Id": mac, "Client-Id": CLIENT_ID, "User-Agent": f"{board}/{version}"}


def body(board: str = BOARD, version: str = "2.4.2") -> dict[str, Any]:
    return {
        "application": {"name": "xiaozhi", "version": version},
        "board": {"type": board, "ssid": "home", "rssi": -60},
        "minimum_free_heap_size": "1000",
    }


@pytest.fixture
async def bridge(bridge_factory: Callable[..., Any], bridge_database_url: str | None) -> Bridge:
    # Shared mode: every device gets the test token straight away, so these tests are about
    # firmware offers only (provisioning has its own tests).
    started: Bridge = await bridge_factory(
        firmware_max_attempts=2, database_url=bridge_database_url
    )
    return started


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


@pytest.fixture
def image(tmp_path: Path) -> Path:
    return write_image(tmp_path / "xiaozhi-2.4.3.bin", bytes([0xE9]) + bytes(range(256)) * 4000)


def write_image(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def digest_and_size(path: Path) -> tuple[str, int]:
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest(), len(data)


async def check(
    http: httpx.AsyncClient, bridge: Bridge, *, board: str = BOARD, version: str = "2.4.2"
) -> dict[str, Any]:
    response = await http.post(
        bridge.provisioning.ota_url,
        json=body(board, version),
        headers=headers(board=board, version=version),
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def publish(bridge: Bridge, board: str, version: str, image: Path) -> tuple[int, str, str]:
    return await run_cli(
        "firmware", "publish", board, version, str(image),
        "--server", bridge.api_url, "--token", ADMIN_TOKEN,
    )  # fmt: skip


async def test_offered_only_to_older_versions_of_the_same_board(
    bridge: Bridge, http: httpx.AsyncClient, image: Path
) -> None:
    assert (await check(http, bridge))["firmware"] == {"version": "2.4.2", "url": ""}
    status, out, err = await publish(bridge, BOARD, "2.4.3", image)
    assert status == 0 and "published bread-compact-wifi 2.4.3" in out, err
    digest, size = digest_and_size(image)
    assert digest in out

    offer = (await check(http, bridge))["firmware"]
    assert offer["version"] == "2.4.3" and offer["sha256"] == digest
    assert offer["size"] == size
    assert "force" not in offer  # never force: no upgrade loop through force
    assert offer["url"].startswith(bridge.provisioning.ota_url.rstrip("/"))
    # Same version, newer version, another board, a version stock firmware cannot parse:
    assert (await check(http, bridge, version="2.4.3"))["firmware"]["url"] == ""
    assert (await check(http, bridge, version="2.10.0"))["firmware"]["url"] == ""
    assert (await check(http, bridge, board="other-board"))["firmware"]["url"] == ""
    assert "firmware" not in await check(http, bridge, version="2.4.2-beta")

    download = await http.get(offer["url"])
    assert download.status_code == 200
    assert int(download.headers["content-length"]) == size
    assert download.headers["x-firmware-sha256"] == digest
    assert hashlib.sha256(download.content).hexdigest() == digest
    missing = await http.get(offer["url"].replace("2.4.3", "9.9.9"))
    assert missing.status_code == 404
    # A Host header without the port (as stock firmware's clients may send it): the download
    # URL still names the listener's port.
    portless = await http.post(
        bridge.provisioning.ota_url,
        json=body(),
        headers={**headers(), "Host": "127.0.0.1"},
    )
    assert portless.json()["firmware"]["url"] == offer["url"]

    status, out, _ = await run_cli(
        "firmware", "releases", "--server", bridge.api_url, "--token", ADMIN_TOKEN
    )
    assert status == 0 and "2.4.3" in out and "bread-compact-wifi" in out


async def test_no_upgrade_loop_when_the_device_keeps_reporting_the_old_version(
    bridge: Bridge, http: httpx.AsyncClient, image: Path
) -> None:
    assert (await publish(bridge, BOARD, "2.4.3", image))[0] == 0
    # The image reports another version than it was published as (or the flash failed):
    # offered firmware_max_attempts (2) times, then no more.
    offers = [(await check(http, bridge))["firmware"]["url"] != "" for _ in range(4)]
    assert offers == [True, True, False, False]
    # A newer release starts afresh; a device that upgraded is offered nothing.
    newer = write_image(image.with_name("xiaozhi-2.4.4.bin"), b"\xe9 another image")
    assert (await publish(bridge, BOARD, "2.4.4", newer))[0] == 0
    assert (await check(http, bridge))["firmware"]["version"] == "2.4.4"
    assert (await check(http, bridge, version="2.4.4"))["firmware"] == {
        "version": "2.4.4",
        "url": "",
    }


async def test_publishing_refuses_what_stock_firmware_cannot_compare(
    bridge: Bridge, image: Path
) -> None:
    for version in ("v2.4.3", "2.4.3-beta", "2..4"):
        status, _out, err = await publish(bridge, BOARD, version, image)
        assert status == 1 and "digits and dots only" in err, err
    assert (await publish(bridge, BOARD, "2.4.3", image))[0] == 0
    status, _out, err = await publish(bridge, BOARD, "2.4.3", image)
    assert status == 1 and "published already" in err
    status, _out, err = await run_cli(
        "firmware", "unpublish", BOARD, "2.4.3", "--server", bridge.api_url, "--token", ADMIN_TOKEN
    )
    assert status == 0, err
    assert bridge.provisioning.releases.releases() == []
    assert not list((bridge.settings.data_dir / "firmware").rglob("*.bin"))


async def test_releases_survive_a_restart(
    bridge_factory: Callable[..., Any],
    tmp_path: Path,
    image: Path,
    http: httpx.AsyncClient,
    bridge_database_url: str | None,
) -> None:
    from backend.auth import Tokens
    from testkit.settings import DEVICE_TOKEN, make_settings

    settings = make_settings(tmp_path / "kept", database_url=bridge_database_url)
    async with Bridge(settings, Tokens(ADMIN_TOKEN, DEVICE_TOKEN)) as bridge:
        # A file already inside the firmware folder is published by its name there.
        folder = bridge.provisioning.releases.directory
        shutil.copy(image, folder / image.name)
        await bridge.provisioning.releases.publish(BOARD, "2.4.3", Path(image.name))
    async with Bridge(settings, Tokens(ADMIN_TOKEN, DEVICE_TOKEN)) as bridge:
        assert (await check(http, bridge))["firmware"]["version"] == "2.4.3"
