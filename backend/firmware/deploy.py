"""Copy a build and a device config to a board with mpremote.

`plan_deploy` does every check that can fail before anything is copied (config, --dest, port,
mpremote) and returns the plan with its warnings; `run_deploy` runs mpremote. Bring the build up
to date in between (`backend.firmware.build.stale_build` / `ensure_build`).
"""

from dataclasses import dataclass
from pathlib import Path

from backend.firmware.build import DEFAULT_OUT, ENTRY_FILES
from backend.firmware.device_config import (
    board_warnings,
    check_device_config,
    check_for_board,
    default_device_config,
    may_use_mqtt,
    read_device_config,
)
from backend.firmware.errors import UsageError
from backend.firmware.tools import check_port, require_tool, run_tool

DEPLOY_TIMEOUT_S = 180.0
# What `"transport": "mqtt"` needs on a board, from the micropython-lib index (mpremote mip).
MQTT_PACKAGES = ("umqtt.simple",)


@dataclass(frozen=True)
class DeployPlan:
    """A checked deploy: what goes where, and the warnings about the config."""

    port: str
    config: Path
    out: Path
    dest: str
    resume: bool
    reset: bool
    mpremote: str
    warnings: tuple[str, ...]
    mip: tuple[str, ...] = ()  # micropython-lib packages the config needs (umqtt for MQTT)

    def command(self) -> list[str]:
        """The mpremote command line that carries the plan out."""
        return deploy_command(
            self.mpremote,
            self.port,
            self.out,
            self.config,
            self.dest,
            self.resume,
            self.reset,
            self.mip,
        )


def plan_deploy(
    port: str,
    config: Path | None = None,
    out: Path = DEFAULT_OUT,
    dest: str = ":",
    *,
    resume: bool = False,
    reset: bool = True,
) -> DeployPlan:
    """Check everything a deploy needs (default config: firmware/config.json)."""
    config_path = config or default_device_config()
    device_config = read_device_config(config_path)
    check_device_config(str(config_path), device_config)
    check_for_board(config_path, device_config)
    check_dest(dest)
    check_port(port)
    mpremote = require_tool("mpremote")
    warnings = tuple(board_warnings(config_path, device_config))
    mip = MQTT_PACKAGES if may_use_mqtt(device_config) else ()
    return DeployPlan(port, config_path, out, dest, resume, reset, mpremote, warnings, mip)


def run_deploy(plan: DeployPlan) -> None:
    """Run mpremote: the build's lib/, main.py and boot.py, then the config as config.json."""
    run_tool(plan.command(), DEPLOY_TIMEOUT_S)


def check_dest(dest: str) -> None:
    """Raise UsageError unless `dest` is a board path (`:` first)."""
    if not dest.startswith(":"):
        raise UsageError(f"--dest must be a board path starting with ':', got {dest!r}")


def remote_path(dest: str, name: str) -> str:
    """`name` under the board folder `dest`."""
    return f"{dest}{name}" if dest.endswith((":", "/")) else f"{dest}/{name}"


def deploy_command(
    mpremote: str,
    port: str,
    out: Path,
    config: Path,
    dest: str = ":",
    resume: bool = False,
    reset: bool = True,
    mip: tuple[str, ...] = (),
) -> list[str]:
    """One mpremote command line (`+`-chained) that copies a build and a config to a board."""
    command = [mpremote, "connect", port, *(["resume"] if resume else [])]
    if mip:  # micropython-lib packages from its index, e.g. umqtt.simple for MQTT
        command += ["mip", "install", *mip, "+"]
    command += ["cp", "-r", str(out / "lib"), dest]
    entries = [str(out / name) for name in ENTRY_FILES if (out / name).is_file()]
    command += ["+", "cp", *entries, dest]
    command += ["+", "cp", str(config), remote_path(dest, "config.json")]
    return command + (["+", "reset"] if reset else [])
