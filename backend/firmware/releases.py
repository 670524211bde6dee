"""Firmware an operator published for a board type, and which device gets offered what.

`esp32-bridge firmware publish BOARD VERSION FILE` copies FILE into the bridge's data
directory (`firmware/<board>/<version>/<sha256 prefix>.bin`, written to a temporary name and
renamed, so a download never sees half a file) and records its size and SHA-256. The OTA
endpoint then offers the newest release of a board to devices of that board that report an
older version (dot-separated integer compare, protocol reference §5.2), never a downgrade,
never `force`.

No upgrade loop: a device that keeps reporting an older version after being offered the same
release `max_attempts` times (its download failed, or the image reports another version than
the one it was published as) is not offered that release again until the bridge restarts or a
newer one is published; the bridge says so once in its log.
"""

import asyncio
import hashlib
import os
import re
import shutil
import sqlite3
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog

from backend.devices.registry import iso_time
from backend.provisioning.errors import InvalidRelease, UnknownRelease
from backend.provisioning.ota import is_newer, parse_version, valid_version
from backend.storage import Database, Migration

log = structlog.get_logger("firmware")

FIRMWARE_MIGRATIONS = (
    Migration(
        "firmware",
        1,
        """
        CREATE TABLE firmware_releases (
            board TEXT NOT NULL,
            version TEXT NOT NULL,
            file TEXT NOT NULL,
            size INTEGER NOT NULL,
            sha256 TEXT NOT NULL,
            published_at REAL NOT NULL,
            PRIMARY KEY (board, version)
        );
        """,
    ),
)

FIRMWARE_DIR = "firmware"
MAX_FIRMWARE_BYTES = 32 << 20  # the biggest ESP32 flash is 32 MiB
_BOARD = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Release:
    board: str
    version: str
    file: str  # relative to the releases folder
    size: int
    sha256: str
    published_at: float
    downloads: int = 0  # since the bridge started

    def to_json(self) -> dict[str, Any]:
        return {
            "board": self.board,
            "version": self.version,
            "size": self.size,
            "sha256": self.sha256,
            "published_at": iso_time(self.published_at),
            "downloads": self.downloads,
        }


def check_board(board: str) -> str:
    if not _BOARD.match(board):
        raise InvalidRelease(f"invalid board type {board[:80]!r} (letters, digits, _ . -)")
    return board


def check_version(version: str) -> str:
    if not valid_version(version):
        raise InvalidRelease(
            f"invalid version {version[:40]!r}: digits and dots only, e.g. 2.4.3 (stock firmware "
            "cannot compare anything else)"
        )
    return version


class FirmwareReleases:
    """Published firmware in the database and the data directory; offers in memory."""

    def __init__(self, database: Database, directory: Path, *, max_attempts: int = 3) -> None:
        self._db = database
        self.directory = directory
        self.max_attempts = max_attempts
        self._releases: dict[tuple[str, str], Release] = {}
        self._offers: dict[str, tuple[str, int]] = {}  # device id -> (version offered, times)

    async def load(self) -> None:
        rows = await self._db.fetchall("SELECT * FROM firmware_releases")
        for row in rows:
            release = Release(
                row["board"],
                row["version"],
                row["file"],
                row["size"],
                row["sha256"],
                row["published_at"],
            )
            if (self.directory / release.file).is_file():
                self._releases[(release.board, release.version)] = release
            else:
                log.warning(
                    "published firmware file is missing; not offered",
                    board=release.board,
                    version=release.version,
                )

    def releases(self) -> list[Release]:
        return sorted(
            self._releases.values(),
            key=lambda r: (r.board, parse_version(r.version) or ()),
        )

    def get(self, board: str, version: str) -> Release:
        release = self._releases.get((board, version))
        if release is None:
            raise UnknownRelease(board, version)
        return release

    def path(self, release: Release) -> Path:
        return self.directory / release.file

    def latest(self, board: str) -> Release | None:
        mine = [r for (b, _v), r in self._releases.items() if b == board]
        return max(mine, key=lambda r: parse_version(r.version) or (), default=None)

    async def publish(self, board: str, version: str, source: Path) -> Release:
        """Copy `source` in and offer it to `board` devices older than `version`."""
        check_board(board)
        check_version(version)
        if (board, version) in self._releases:
            raise InvalidRelease(
                f"{board} {version} is published already; unpublish it first or use a new version"
            )
        size, digest, stored = await asyncio.to_thread(
            _copy_in, source, self.directory / board / version
        )
        release = Release(
            board, version, str(stored.relative_to(self.directory)), size, digest, time.time()
        )

        def write(c: sqlite3.Connection) -> None:
            c.execute(
                "INSERT INTO firmware_releases (board, version, file, size, sha256, published_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (release.board, release.version, release.file, size, digest, release.published_at),
            )

        await self._db.run(write)
        self._releases[(board, version)] = release
        log.info("firmware published", board=board, version=version, size=size, sha256=digest)
        return release

    async def unpublish(self, board: str, version: str) -> Release:
        release = self.get(board, version)
        await self._db.execute(
            "DELETE FROM firmware_releases WHERE board = ? AND version = ?", (board, version)
        )
        self._releases.pop((board, version), None)
        shutil.rmtree(self.directory / board / version, ignore_errors=True)
        log.info("firmware unpublished", board=board, version=version)
        return release

    def offer(self, device_id: str, board: str | None, current: str | None) -> Release | None:
        """The release to offer this device now, or None (see the module's loop rule)."""
        release = self.latest(board) if board else None
        if release is None or not is_newer(release.version, current):
            self._offers.pop(device_id, None)
            return None
        version, times = self._offers.get(device_id, (release.version, 0))
        if version != release.version:
            times = 0
        if times >= self.max_attempts:
            if times == self.max_attempts:
                log.warning(
                    "firmware upgrade given up: the device still reports an older version",
                    device_id=device_id,
                    offered=release.version,
                    reported=current,
                    attempts=times,
                )
                self._offers[device_id] = (release.version, times + 1)
            return None
        self._offers[device_id] = (release.version, times + 1)
        return release

    def downloaded(self, release: Release) -> None:
        current = self._releases.get((release.board, release.version))
        if current is not None:
            self._releases[(release.board, release.version)] = replace(
                current, downloads=current.downloads + 1
            )


def _copy_in(source: Path, folder: Path) -> tuple[int, str, Path]:
    """(size, SHA-256, stored path) of `source`, copied into `folder` under its hash."""
    try:
        size = source.stat().st_size
    except OSError as exc:
        raise InvalidRelease(f"cannot read {source}: {exc.strerror or exc}") from None
    if not source.is_file() or size == 0:
        raise InvalidRelease(f"{source} is not a non-empty file")
    if size > MAX_FIRMWARE_BYTES:
        raise InvalidRelease(f"{source} is larger than {MAX_FIRMWARE_BYTES} bytes")
    folder.mkdir(parents=True, exist_ok=True)
    scratch = folder / f".upload-{os.getpid()}-{time.monotonic_ns()}"
    digest = hashlib.sha256()
    try:
        with source.open("rb") as reader, scratch.open("wb") as writer:
            while chunk := reader.read(1 << 16):
                digest.update(chunk)
                writer.write(chunk)
        stored = folder / f"{digest.hexdigest()[:16]}.bin"
        scratch.replace(stored)
    except OSError as exc:
        scratch.unlink(missing_ok=True)
        raise InvalidRelease(f"cannot copy {source}: {exc.strerror or exc}") from None
    return size, digest.hexdigest(), stored
