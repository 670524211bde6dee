"""Firmware an operator published for a board type, and which device gets offered what.

`esp32-bridge firmware publish BOARD VERSION FILE` uploads FILE through the admin API into the
bridge's firmware folder (`<data_dir>/firmware/<board>/<version>/<sha256 prefix>.bin`, written
to a temporary name and renamed, so a download never sees half a file) and records its size
and SHA-256. What can be published is only what was uploaded, or a file already inside the
firmware folder (symlinks resolved, nothing that leads out of it): an admin key never turns a
file of the host (the bridge's secret, its database, /etc/passwd) into a download. Board and
version are single safe path components. A download serves a release's own artifact only, at
the path derived from its recorded board, version and hash, never a path built from the
request. The OTA
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
import stat
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import structlog

from backend.common import iso_time
from backend.provisioning.errors import InvalidRelease, UnknownRelease
from backend.provisioning.ota import is_newer, parse_version, valid_version
from backend.storage import Connection, Database, Migration

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
            published_at {real} NOT NULL,
            PRIMARY KEY (board, version)
        );
        """,
    ),
)

FIRMWARE_DIR = "firmware"
MAX_FIRMWARE_BYTES = 32 << 20  # the biggest ESP32 flash is 32 MiB
UPLOADS = ".uploads"  # scratch files of uploads in progress, inside the firmware folder
# One path component: starts with a letter or digit (so never "." or ".."), ASCII only, no
# separator, NUL or control character; fullmatch, since "$" would let a trailing newline in.
_BOARD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
_VERSION = re.compile(r"[0-9]{1,9}(\.[0-9]{1,9}){0,3}")
_ARTIFACT = re.compile(r"[0-9a-f]{16}\.bin")


@dataclass(frozen=True, slots=True)
class Release:
    """One published firmware: its board, version, stored file, size and SHA-256."""

    board: str
    version: str
    file: str  # relative to the releases folder
    size: int
    sha256: str
    published_at: float
    downloads: int = 0  # since the bridge started

    def to_json(self) -> dict[str, Any]:
        """The release as the API lists it (not its file path)."""
        return {
            "board": self.board,
            "version": self.version,
            "size": self.size,
            "sha256": self.sha256,
            "published_at": iso_time(self.published_at),
            "downloads": self.downloads,
        }


def check_board(board: str) -> str:
    """The board type if valid (also a path segment, so no `..`); raises InvalidRelease."""
    if not _BOARD.fullmatch(board) or ".." in board:
        raise InvalidRelease(
            f"invalid board type {board[:80]!r}: 1 to 64 ASCII letters, digits, _ . -, "
            "starting with a letter or digit, no '..'"
        )
    return board


def check_version(version: str) -> str:
    """The version if stock firmware can compare it (digits and dots); raises InvalidRelease."""
    if not _VERSION.fullmatch(version) or not valid_version(version):
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
        """Create the releases folder if missing and read the published releases."""
        # Created up front: it is where an operator drops files to publish by name.
        await asyncio.to_thread(self.directory.mkdir, parents=True, exist_ok=True)
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
            problem = await asyncio.to_thread(self._artifact_problem, release)
            if problem is None:
                self._releases[(release.board, release.version)] = release
            else:
                log.warning(
                    "published firmware not offered",
                    reason=problem,
                    board=release.board[:80],
                    version=release.version[:40],
                )

    def _artifact_problem(self, release: Release) -> str | None:
        """Why a recorded release cannot be served (None: it can): a name that is not a safe
        path component, a file not where its hash puts it, or content that changed."""
        try:
            check_board(release.board)
            check_version(release.version)
        except InvalidRelease:
            return "unsafe board or version name"
        try:
            with self.open(release) as reader:
                digest = _hash_all(reader)
        except OSError as exc:
            return f"artifact unreadable: {exc.strerror or exc}"
        return None if digest == release.sha256 else "artifact content changed"

    def releases(self) -> list[Release]:
        """Every release, by board then version."""
        return sorted(
            self._releases.values(),
            key=lambda r: (r.board, parse_version(r.version) or ()),
        )

    def get(self, board: str, version: str) -> Release:
        """The release of this board and version; raises UnknownRelease."""
        release = self._releases.get((board, version))
        if release is None:
            raise UnknownRelease(board, version)
        return release

    def path(self, release: Release) -> Path:
        """Where the release's artifact is: derived from its recorded board, version and hash
        (never from request input), and required to match the recorded file name."""
        relative = f"{release.board}/{release.version}/{release.sha256[:16]}.bin"
        if release.file != relative or not _ARTIFACT.fullmatch(relative.rsplit("/", 1)[1]):
            raise OSError(f"release {release.board} {release.version}: unexpected file name")
        check_board(release.board)
        check_version(release.version)
        return self.directory / relative

    def open(self, release: Release) -> BinaryIO:
        """The release's artifact, opened for reading: a regular file inside the firmware
        folder, reached through no symlink, of the recorded size (OSError otherwise)."""
        path = self.path(release)
        root = self.directory.resolve()
        if path.resolve() != root / release.file:
            raise OSError(f"{release.file} leads out of the firmware folder")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        reader = os.fdopen(fd, "rb")
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != release.size:
            reader.close()
            raise OSError(f"{release.file} is not the published file")
        return reader

    def latest(self, board: str) -> Release | None:
        """The newest release for the board, if any."""
        mine = [r for (b, _v), r in self._releases.items() if b == board]
        return max(mine, key=lambda r: parse_version(r.version) or (), default=None)

    async def publish(self, board: str, version: str, source: Path) -> Release:
        """Copy `source`, a file inside the firmware folder, in and offer it to `board`
        devices older than `version`."""
        self._check_new(board, version)
        size, digest, stored = await asyncio.to_thread(self._copy_local, source, board, version)
        return await self._record(board, version, size, digest, stored)

    async def upload(self, board: str, version: str, chunks: AsyncIterable[bytes]) -> Release:
        """Store an uploaded image (at most MAX_FIRMWARE_BYTES) and offer it like `publish`."""
        self._check_new(board, version)
        folder = self.directory / UPLOADS
        await asyncio.to_thread(_make_folder, folder, self.directory)
        scratch = folder / f"{os.getpid()}-{time.monotonic_ns()}"
        try:
            size, digest = await _receive(chunks, scratch)
            stored = await asyncio.to_thread(self._place, scratch, board, version, digest)
        finally:
            scratch.unlink(missing_ok=True)
        return await self._record(board, version, size, digest, stored)

    def _check_new(self, board: str, version: str) -> None:
        check_board(board)
        check_version(version)
        if (board, version) in self._releases:
            raise InvalidRelease(
                f"{board} {version} is published already; unpublish it first or use a new version"
            )

    def _copy_local(self, source: Path, board: str, version: str) -> tuple[int, str, Path]:
        inside = self._inside_folder(source)
        folder = self._release_folder(board, version)
        return _copy_in(inside, folder)

    def _inside_folder(self, source: Path) -> Path:
        """`source` resolved (symlinks followed), if it is a file inside the firmware folder
        and not in a release or upload folder's scratch; InvalidRelease otherwise."""
        if not source.is_absolute():
            source = self.directory / source
        root = self.directory.resolve()
        if self.directory.parent.resolve().is_relative_to(root):
            raise InvalidRelease("the firmware folder contains the bridge's data directory")
        try:
            resolved = source.resolve()  # where symlinks lead; whether it exists comes after
        except (OSError, RuntimeError, ValueError):  # a symlink loop, unencodable text
            resolved = root.parent
        if resolved == root or not resolved.is_relative_to(root):
            raise InvalidRelease(
                f"only files inside the firmware folder ({self.directory}) can be published;"
                " upload the file instead (esp32-bridge firmware publish does)"
            )
        try:
            is_file = resolved.is_file()
        except OSError:  # a name too long for the file system (ENAMETOOLONG) names no file
            is_file = False
        if not is_file:
            raise InvalidRelease(f"no such file in the firmware folder: {str(source)[:200]}")
        if resolved.relative_to(root).parts[0] == UPLOADS:
            raise InvalidRelease("files of uploads in progress cannot be published")
        return resolved

    def _release_folder(self, board: str, version: str) -> Path:
        """<folder>/<board>/<version>, created; refused if it would lead out of the folder
        (a symlink planted as a board folder)."""
        folder = self.directory / board / version
        _make_folder(folder, self.directory)
        return folder

    def _place(self, scratch: Path, board: str, version: str, digest: str) -> Path:
        stored = self._release_folder(board, version) / f"{digest[:16]}.bin"
        scratch.replace(stored)
        return stored

    async def _record(
        self, board: str, version: str, size: int, digest: str, stored: Path
    ) -> Release:
        release = Release(
            board, version, str(stored.relative_to(self.directory)), size, digest, time.time()
        )

        def write(c: Connection) -> None:
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
        """Withdraw a release (devices stop being offered it); raises UnknownRelease."""
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
        """Count one download of the release (in memory: counted since the bridge started)."""
        current = self._releases.get((release.board, release.version))
        if current is not None:
            self._releases[(release.board, release.version)] = replace(
                current, downloads=current.downloads + 1
            )


def _make_folder(folder: Path, root: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if not folder.resolve().is_relative_to(root.resolve()):
        raise InvalidRelease(f"{folder.relative_to(root)} leads out of the firmware folder")


def _hash_all(reader: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := reader.read(1 << 16):
        digest.update(chunk)
    return digest.hexdigest()


async def _receive(chunks: AsyncIterable[bytes], scratch: Path) -> tuple[int, str]:
    """(size, SHA-256) of an upload written to `scratch`; InvalidRelease past the cap or empty."""
    digest = hashlib.sha256()
    size = 0
    with scratch.open("xb") as writer:
        async for chunk in chunks:
            size += len(chunk)
            if size > MAX_FIRMWARE_BYTES:
                raise InvalidRelease(f"the image is larger than {MAX_FIRMWARE_BYTES} bytes")
            digest.update(chunk)
            await asyncio.to_thread(writer.write, chunk)
    if size == 0:
        raise InvalidRelease("the upload is empty")
    return size, digest.hexdigest()


def _copy_in(source: Path, folder: Path) -> tuple[int, str, Path]:
    """(size, SHA-256, stored path) of `source`, copied into `folder` under its hash. Opened
    without following a symlink, so the file checked is the file read."""
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InvalidRelease(f"cannot read {source}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as reader:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size == 0:
            raise InvalidRelease(f"{source} is not a non-empty file")
        if info.st_size > MAX_FIRMWARE_BYTES:
            raise InvalidRelease(f"{source} is larger than {MAX_FIRMWARE_BYTES} bytes")
        return _write_in(reader, source, folder)


def _write_in(reader: BinaryIO, source: Path, folder: Path) -> tuple[int, str, Path]:
    scratch = folder / f".upload-{os.getpid()}-{time.monotonic_ns()}"
    digest = hashlib.sha256()
    size = 0
    try:
        with scratch.open("xb") as writer:
            while chunk := reader.read(1 << 16):
                size += len(chunk)
                if size > MAX_FIRMWARE_BYTES:
                    raise InvalidRelease(f"{source} is larger than {MAX_FIRMWARE_BYTES} bytes")
                digest.update(chunk)
                writer.write(chunk)
        stored = folder / f"{digest.hexdigest()[:16]}.bin"
        scratch.replace(stored)
    except OSError as exc:
        raise InvalidRelease(f"cannot copy {source}: {exc.strerror or exc}") from None
    finally:
        scratch.unlink(missing_ok=True)
    return size, digest.hexdigest(), stored
