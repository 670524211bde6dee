"""Build the firmware as it goes to a board: lib/*.py compiled by mpy-cross into .mpy, main.py and
boot.py as source, and a MANIFEST.json that says what was built from what (for staleness)."""

import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.firmware.errors import BuildFailed, ToolFailed, UsageError
from backend.firmware.source import firmware_source
from backend.firmware.tools import require_tool, tool_error

HOST_ONLY_MODULES = frozenset({"compat_cpython.py"})  # CPython fallbacks, never on a device
ENTRY_FILES = ("boot.py", "main.py")  # MicroPython runs these as source, never as .mpy
MANIFEST = "MANIFEST.json"
DEFAULT_OUT = Path("build/firmware")
# -march only matters for @micropython.native/viper code precompiled into a .mpy; "none" omits it.
MARCHES = ("xtensawin", "rv32imc", "host", "none")
DEFAULT_MARCH = "xtensawin"
COMPILE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class BuiltFile:
    """One file of a firmware build, at its path on the board."""

    path: str  # relative to the build folder, as it lands on the board
    size: int


@dataclass(frozen=True)
class Rebuild:
    """A build folder that is missing or older than its sources, and how to build it again."""

    source: Path
    out: Path
    march: str
    compiled: bool


def check_march(march: str) -> None:
    """Raise UsageError unless `march` is an architecture mpy-cross knows."""
    if march not in MARCHES:
        raise UsageError(f"unknown --march {march!r}: use one of {', '.join(MARCHES)}")


def source_files(source: Path) -> list[Path]:
    """Everything that goes to the board, relative to `source`: lib modules, then entry files."""
    modules = sorted(
        path.relative_to(source)
        for path in (source / "lib").glob("*.py")
        if path.name not in HOST_ONLY_MODULES
    )
    return modules + [Path(name) for name in ENTRY_FILES if (source / name).is_file()]


def build(
    source: Path | None,
    out: Path,
    march: str = DEFAULT_MARCH,
    *,
    compiled: bool = True,
) -> list[BuiltFile]:
    """Build `source` (default: the firmware folder) into `out` and return what was written.

    `compiled=False` copies lib/*.py as they are (the board then compiles them at import).
    The build goes into a fresh folder beside `out` that replaces it only when complete, so a
    failed build changes nothing; a folder that is not an earlier build is never replaced."""
    check_march(march)
    source = firmware_source(source)
    mpy_cross = require_tool("mpy-cross") if compiled else None
    version = mpy_cross_version(mpy_cross) if mpy_cross else None
    sources = source_files(source)
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


def mpy_cross_version(mpy_cross: str) -> str:
    """`mpy-cross --version`, e.g. "MicroPython v1.29.0 on ...; mpy-cross emitting mpy v6.3"."""
    try:
        completed = subprocess.run(
            [mpy_cross, "--version"], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolFailed(f"cannot run mpy-cross: {exc}") from None
    return completed.stdout.strip()


def read_manifest(out: Path) -> dict[str, Any] | None:
    """The build's MANIFEST.json, or None when `out` holds no readable build."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def is_current(out: Path, manifest: dict[str, Any], source: Path) -> bool:
    """True when no source file was added, removed or changed since the build."""
    sources = source_files(source)
    if [path.as_posix() for path in sources] != manifest.get("sources"):
        return False
    if not all((out / str(item.get("path"))).is_file() for item in manifest.get("files", [])):
        return False
    built_at = (out / MANIFEST).stat().st_mtime
    return all((source / path).stat().st_mtime <= built_at for path in sources)


def stale_build(out: Path) -> Rebuild | None:
    """None when `out` is a build that is current; else the rebuild it needs, with the source
    folder, --march and compilation of the earlier build (defaults when there is none)."""
    manifest = read_manifest(out)
    recorded = Path(manifest["source"]) if manifest and "source" in manifest else None
    source = firmware_source(recorded if recorded and recorded.is_dir() else None)
    if manifest is not None and is_current(out, manifest, source):
        return None
    march = str(manifest.get("march", DEFAULT_MARCH)) if manifest else DEFAULT_MARCH
    compiled = manifest.get("compiled") is not False if manifest else True
    return Rebuild(source, out, march, compiled)


def ensure_build(out: Path) -> Rebuild | None:
    """Rebuild `out` when it is missing or older than its sources; returns what was rebuilt."""
    plan = stale_build(out)
    if plan is not None:
        build(plan.source, plan.out, plan.march, compiled=plan.compiled)
    return plan


def _check_out(out: Path) -> None:
    """Refuse to replace anything but an earlier build of ours."""
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file()):
        raise BuildFailed(f"{out} exists and is not a firmware build folder: choose another --out")


def _compile(mpy_cross: str, source_file: Path, target: Path, name: str, march: str) -> None:
    arch = [] if march == "none" else [f"-march={march}"]
    # -s: tracebacks on the board name lib/x.py instead of this machine's absolute path.
    command = [mpy_cross, "-O2", *arch, "-s", name, "-o", str(target), str(source_file)]
    try:
        completed = subprocess.run(
            command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolFailed(f"cannot compile {source_file}: {exc}") from None
    if completed.returncode != 0:
        line = re.search(r"line (\d+)", completed.stderr)
        where = f"{source_file} line {line[1]}" if line else str(source_file)
        raise BuildFailed(f"{where}: {tool_error(completed.stderr + completed.stdout)}")


def _build_file(
    mpy_cross: str | None, source: Path, relative: Path, out: Path, march: str
) -> BuiltFile:
    """lib/x.py becomes lib/x.mpy (unless not compiling); entry files are copied as source."""
    (out / relative).parent.mkdir(exist_ok=True)
    if relative.parent.name == "lib" and mpy_cross is not None:
        target = relative.with_suffix(".mpy")
        _compile(mpy_cross, source / relative, out / target, relative.as_posix(), march)
    else:
        target = relative
        shutil.copyfile(source / relative, out / target)
    return BuiltFile(target.as_posix(), (out / target).stat().st_size)


def _write_manifest(
    out: Path,
    source: Path,
    march: str,
    version: str | None,
    sources: list[Path],
    built: list[BuiltFile],
) -> None:
    mpy_version = re.search(r"mpy v(\d+\.\d+)", version) if version else None
    manifest = {
        "source": str(source.resolve()),
        "sources": [path.as_posix() for path in sources],
        "march": march,
        "compiled": version is not None,
        "mpy_cross": version,
        "mpy_version": mpy_version[1] if mpy_version else None,
        "files": [{"path": item.path, "bytes": item.size} for item in built],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
