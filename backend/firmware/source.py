"""Where the firmware sources are: `firmware/` of a source checkout, or the copy in the wheel.

A wheel carries `firmware/lib`, `main.py`, `boot.py` and `config.example.json` as
`backend/firmware/_firmware` (pyproject.toml, `force-include`); a source checkout (also an
editable install) has `firmware/` beside `backend/`.
"""

import importlib.util
from functools import cache
from pathlib import Path
from types import ModuleType

from backend.firmware.errors import SourceNotFound

_HERE = Path(__file__).resolve().parent
PACKAGED = _HERE / "_firmware"
CHECKOUT = _HERE.parent.parent / "firmware"


def firmware_candidates() -> tuple[Path, ...]:
    """The folders `firmware_dir` tries, in order."""
    return (PACKAGED, CHECKOUT)


def is_firmware_dir(path: Path) -> bool:
    """Whether the folder is the firmware's source (has `main.py` and `lib/mcp_server.py`)."""
    return (path / "lib" / "mcp_server.py").is_file() and (path / "main.py").is_file()


def firmware_dir() -> Path:
    """The firmware folder (main.py, lib/) that came with this package; SourceNotFound if none."""
    for candidate in firmware_candidates():
        if is_firmware_dir(candidate):
            return candidate
    raise SourceNotFound(
        "firmware sources not found: expected firmware/ beside backend/ (a source checkout) "
        "or an installed wheel"
    )


def firmware_source(source: Path | None = None) -> Path:
    """`source` if it is a firmware folder (SourceNotFound if not), else `firmware_dir()`."""
    if source is None:
        return firmware_dir()
    if not (source / "lib").is_dir() or not (source / "main.py").is_file():
        raise SourceNotFound(f"{source} is not a firmware folder (expected main.py and lib/)")
    return source


@cache
def firmware_entry() -> ModuleType:
    """The firmware's main.py as a module (it runs nothing on import), for its config check.

    Loading it puts the firmware's lib/ on sys.path, as main.py does on a host."""
    path = firmware_dir() / "main.py"
    spec = importlib.util.spec_from_file_location("esp32_bridge_firmware_main", path)
    if spec is None or spec.loader is None:
        raise SourceNotFound(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
