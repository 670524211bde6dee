"""An admin key cannot publish a file of the host, and the device listener serves nothing but
published artifacts: every attack over real loopback HTTP, each refused with a 4xx and nothing
written outside the firmware folder (issue 16, item 6)."""

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import pytest

from backend.provisioning.tokens import SECRET_FILE
from backend.server import Bridge
from testkit.settings import ADMIN_TOKEN

BOARD = "bread-compact-wifi"
IMAGE = bytes([0xE9]) + bytes(range(256)) * 64
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
async def bridge(bridge_factory: Callable[..., Any]) -> Bridge:
    started: Bridge = await bridge_factory()
    return started


@pytest.fixture
async def api(bridge: Bridge) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=bridge.api_url, headers=AUTH, timeout=10) as client:
        yield client


def folder(bridge: Bridge) -> Path:
    return bridge.provisioning.releases.directory


def files_outside_folder(bridge: Bridge) -> dict[Path, tuple[int, int]]:
    """Every file under the data dir's parent but outside the firmware folder, with its size and
    modification time (the database, which the bridge itself writes, is left out)."""
    root = bridge.settings.data_dir.parent
    inside = folder(bridge)
    return {
        path: (path.lstat().st_size, path.lstat().st_mtime_ns)
        for path in root.rglob("*")
        if not path.is_relative_to(inside) and not path.name.startswith("bridge.sqlite3")
    }


def both_are_files(*paths: Path) -> bool:
    return all(path.is_file() for path in paths)


async def publish_path(api: httpx.AsyncClient, path: str, board: str = BOARD) -> httpx.Response:
    return await api.post("/api/firmware", json={"board": board, "version": "2.4.3", "path": path})


def assert_refused(response: httpx.Response, status: int = 422) -> str:
    assert response.status_code == status, response.text
    message: str = response.json()["error"]["message"]
    return message


async def test_host_files_cannot_be_published(bridge: Bridge, api: httpx.AsyncClient) -> None:
    data = bridge.settings.data_dir
    secret = data / SECRET_FILE
    database = Path(bridge.provisioning._database_path)
    assert both_are_files(secret, database)
    before = files_outside_folder(bridge)
    for target in ("/etc/passwd", str(secret), str(database), f"{folder(bridge)}/../{SECRET_FILE}"):
        message = assert_refused(await publish_path(api, target))
        assert "only files inside the firmware folder" in message, message
    # Relative paths are taken inside the folder; one that climbs out is refused the same way.
    for relative in (f"../{SECRET_FILE}", "../bridge.sqlite3", "../../../../etc/passwd"):
        assert "only files inside" in assert_refused(await publish_path(api, relative))
    # A symlink planted in the folder that points out, directly or through a linked folder:
    (folder(bridge) / "innocent.bin").symlink_to(secret)
    (folder(bridge) / "linked").symlink_to(data)
    for planted in ("innocent.bin", str(folder(bridge) / "innocent.bin"), "linked/bridge.sqlite3"):
        assert "only files inside" in assert_refused(await publish_path(api, planted))
    # A NUL in the path, a path that does not exist, and the folder itself:
    assert assert_refused(await publish_path(api, "x\u0000.bin"))
    assert "no such file" in assert_refused(await publish_path(api, "missing.bin"))
    assert "only files inside" in assert_refused(await publish_path(api, "."))
    assert (await api.get("/api/firmware")).json()["releases"] == []
    assert files_outside_folder(bridge) == before
    # No release folder was made: only what the test planted is in the firmware folder.
    assert sorted(entry.name for entry in folder(bridge).iterdir()) == ["innocent.bin", "linked"]


@pytest.mark.parametrize(
    ("board", "version"),
    [
        ("..", "2.4.3"),
        (".", "2.4.3"),
        ("../x", "2.4.3"),
        ("a/b", "2.4.3"),
        ("..\\x", "2.4.3"),
        ("a\u0000b", "2.4.3"),
        ("a\nb", "2.4.3"),
        ("board\n", "2.4.3"),
        ("bo\u0430rd", "2.4.3"),  # a Cyrillic letter
        ("x" * 65, "2.4.3"),
        (BOARD, "2.4/3"),
        (BOARD, "../2.4.3"),
        (BOARD, "2.4.3\n"),
        (BOARD, ".."),
        (BOARD, "2.\u0664.3"),  # an Arabic-Indic digit, which int() would take
    ],
)
async def test_unsafe_board_and_version_names_are_refused(
    bridge: Bridge, api: httpx.AsyncClient, board: str, version: str
) -> None:
    (folder(bridge) / "image.bin").write_bytes(IMAGE)
    before = files_outside_folder(bridge)
    response = await api.post(
        "/api/firmware", json={"board": board, "version": version, "path": "image.bin"}
    )
    message = assert_refused(response)
    assert "invalid" in message or "at most 64" in message, message
    # The same names through the upload route, percent-encoded into the URL:
    quoted = "/".join(quote(part, safe="").replace(".", "%2E") for part in (board, version))
    uploaded = await api.put(f"/api/firmware/{quoted}", content=IMAGE)
    assert 400 <= uploaded.status_code < 500, uploaded.text
    assert (await api.get("/api/firmware")).json()["releases"] == []
    assert files_outside_folder(bridge) == before
    assert [p for p in folder(bridge).rglob("*") if p.is_file()] == [folder(bridge) / "image.bin"]


async def test_legitimate_upload_and_local_publish_are_served(
    bridge: Bridge, api: httpx.AsyncClient
) -> None:
    uploaded = await api.put(f"/api/firmware/{BOARD}/2.4.3", content=IMAGE)
    assert uploaded.status_code == 201, uploaded.text
    assert uploaded.json()["sha256"] == hashlib.sha256(IMAGE).hexdigest()
    (folder(bridge) / "dropped.bin").write_bytes(IMAGE + b"2")
    published = await publish_path(api, "dropped.bin", board="other-board")
    assert published.status_code == 201, published.text
    async with httpx.AsyncClient(timeout=10) as device:
        for board, content in ((BOARD, IMAGE), ("other-board", IMAGE + b"2")):
            url = f"{bridge.provisioning.ota_url}firmware/{board}/2.4.3"
            got = await device.get(url)
            assert got.status_code == 200 and got.content == content
            assert got.headers["content-length"] == str(len(content))
            assert got.headers["x-firmware-sha256"] == hashlib.sha256(content).hexdigest()
            head = await device.head(url)
            assert head.status_code == 200 and head.headers["content-length"] == str(len(content))
    # Uploaded scratch files do not linger.
    assert not [p for p in (folder(bridge) / ".uploads").iterdir()]


async def test_upload_size_is_capped(bridge: Bridge, api: httpx.AsyncClient) -> None:
    too_big = {"Content-Length": str((32 << 20) + 1), "Content-Type": "application/octet-stream"}
    response = await raw_request(
        bridge.api_url, "PUT", f"/api/firmware/{BOARD}/2.4.3", {**AUTH, **too_big}
    )
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    # Only an admin's firmware upload gets the larger cap: elsewhere the 64 KiB cap holds.
    other = await api.post("/api/firmware", content=b"x" * 70_000)
    assert other.status_code == 413
    assert (await api.put(f"/api/firmware/{BOARD}/2.4.3", content=b"")).status_code == 422


@pytest.mark.parametrize(
    "path",
    [
        "firmware/../../device-credentials.secret",
        "firmware/%2e%2e/%2e%2e/device-credentials.secret",
        "firmware/%2e%2e%2f%2e%2e%2fdevice-credentials.secret/2.4.3",
        f"firmware/{BOARD}/..%2f..%2f..%2fdevice-credentials.secret",
        f"firmware/{BOARD}/%2e%2e%2f2.4.3",
        f"firmware/..%2f{BOARD}/2.4.3",
        f"firmware/{BOARD}/2.4.3%2f..%2f..%2f..%2f..%2fdevice-credentials.secret",
        f"firmware/{BOARD}/2.4.3%00",
        "firmware/..%5c..%5cdevice-credentials.secret/x",
        "firmware//etc/passwd",
        "firmware/%2fetc%2fpasswd/2.4.3",
    ],
)
async def test_download_traversal_is_refused(
    bridge: Bridge, api: httpx.AsyncClient, path: str
) -> None:
    assert (await api.put(f"/api/firmware/{BOARD}/2.4.3", content=IMAGE)).status_code == 201
    secret = (bridge.settings.data_dir / SECRET_FILE).read_bytes()
    target = urlsplit(bridge.provisioning.ota_url)
    answer = await raw_request(f"http://{target.netloc}", "GET", f"{target.path}{path}", {})
    status = int(answer.split(b" ", 2)[1])
    assert 400 <= status < 500, answer[:200]
    assert secret.strip() not in answer and b"root:" not in answer


async def test_a_swapped_artifact_is_not_served(bridge: Bridge, api: httpx.AsyncClient) -> None:
    """Served files are exactly the published artifacts: one replaced by a symlink (or changed
    in size) after publishing is refused, not followed."""
    assert (await api.put(f"/api/firmware/{BOARD}/2.4.3", content=IMAGE)).status_code == 201
    stored = next(folder(bridge).glob(f"{BOARD}/2.4.3/*.bin"))
    url = f"{bridge.provisioning.ota_url}firmware/{BOARD}/2.4.3"
    stored.unlink()
    stored.symlink_to(bridge.settings.data_dir / SECRET_FILE)
    async with httpx.AsyncClient(timeout=10) as device:
        assert (await device.get(url)).status_code == 404
        stored.unlink()
        stored.write_bytes(IMAGE + b"longer")
        assert (await device.get(url)).status_code == 404


async def test_an_unsafe_release_recorded_earlier_is_not_offered(
    bridge_factory: Callable[..., Any],
) -> None:
    """A row a bridge before this check recorded (board `..`) is left out at start."""
    first: Bridge = await bridge_factory()
    releases = first.provisioning.releases
    outside = releases.directory.parent / "2.4.3"
    outside.mkdir()
    (outside / "0000000000000000.bin").write_bytes(IMAGE)
    await first.database.execute(
        "INSERT INTO firmware_releases VALUES (?, ?, ?, ?, ?, ?)",
        ("..", "2.4.3", "../2.4.3/0000000000000000.bin", len(IMAGE), "0" * 64, 0.0),
    )
    await releases.load()
    assert releases.releases() == []


async def raw_request(base: str, method: str, target: str, headers: dict[str, str]) -> bytes:
    """One request written byte for byte (no client normalizes the path), the answer read."""
    parts = urlsplit(base)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    reader, writer = await asyncio.open_connection(host, port)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(1 << 20), 10)
    finally:
        writer.close()
        await writer.wait_closed()
