"""A real HAProxy running the SHIPPED deploy/haproxy.cfg, with only its `bind` and `server`
lines rewritten to loopback ports: every other line (mode, balance, retries, redispatch, health
checks, intervals, timeouts, per-source limits) is the committed one.

Used by tests/test_cluster_deploy.py and bench/cluster.py (the failover figure is what a user of
the shipped file gets)."""

import asyncio
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"

# The compose file's port numbers, which the shipped file uses: the device WebSocket, the OTA
# HTTP port and the admin API (health checks, and the API frontend).
WS_PORT, OTA_PORT, ADMIN_PORT = "8000", "8002", "8003"

SERVER = re.compile(
    r"^(?P<indent>[ \t]*)server[ \t]+(?P<name>\S+)[ \t]+(?P<host>[^\s:]+):(?P<port>\d+)"
    r"(?P<rest>[^\n]*)$",
    re.MULTILINE,
)
BIND = re.compile(r"^(?P<indent>[ \t]*)bind[ \t]+:(?P<port>\d+)[ \t]*$", re.MULTILINE)
CHECK_PORT = re.compile(r"\bcheck port (\d+)\b")


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")


@dataclass(frozen=True)
class InstancePorts:
    """Where one instance listens, by the compose file's port numbers ("8000" -> 43121)."""

    by_compose_port: dict[str, int]


def render(config: str, instances: dict[str, InstancePorts], binds: dict[str, int]) -> str:
    """`config` with its `bind` ports and its `server` addresses replaced: a compose instance
    not in `instances`, or one without the server line's port (a frontend not under test), loses
    its `server` line; a `bind` port not in `binds` gets a free loopback port."""

    def server(m: re.Match[str]) -> str:
        ports = instances.get(m["name"])
        if ports is None or m["port"] not in ports.by_compose_port:
            return f"{m['indent']}# {m['name']}: not started here"
        rest = CHECK_PORT.sub(
            lambda c: f"check port {ports.by_compose_port[c.group(1)]}", m["rest"]
        )
        address = f"127.0.0.1:{ports.by_compose_port[m['port']]}"
        return f"{m['indent']}server {m['name']} {address}{rest}"

    def bind(m: re.Match[str]) -> str:
        port = binds.get(m["port"]) or _free_port()
        return f"{m['indent']}bind 127.0.0.1:{port}"

    rendered = BIND.sub(bind, SERVER.sub(server, config))
    assert SERVER.findall(rendered), "no server left"
    return rendered


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class HAProxy:
    """HAProxy in the foreground on a rendered configuration; its log lines in `output`."""

    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path
        self.log_path = config_path.with_suffix(".log")
        self._process: asyncio.subprocess.Process | None = None

    @classmethod
    def shipped(
        cls, workdir: Path, instances: dict[str, InstancePorts], binds: dict[str, int]
    ) -> "HAProxy":
        """The shipped deploy/haproxy.cfg, rendered for these instances, in `workdir`."""
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / "haproxy.cfg"
        path.write_text(render(HAPROXY_CFG.read_text(), instances, binds))
        return cls(path)

    def check(self) -> subprocess.CompletedProcess[str]:
        binary = haproxy_binary()
        assert binary is not None
        return subprocess.run(
            [binary, "-c", "-f", str(self.config_path)], capture_output=True, text=True
        )

    async def start(self, port: int) -> None:
        """Start and wait until `port` (one of its binds) accepts connections."""
        binary = haproxy_binary()
        assert binary is not None
        with self.log_path.open("wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                binary, "-db", "-f", str(self.config_path), stdout=log, stderr=log
            )
        deadline = time.monotonic() + 10
        while not (accepts(port) or self._exited()):
            if time.monotonic() > deadline:
                raise AssertionError(f"HAProxy not listening on {port}: {self.output}")
            await asyncio.sleep(0.02)
        assert not self._exited(), self.output

    async def stop(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.terminate()
            try:
                async with asyncio.timeout(5):
                    await self._process.wait()
            except TimeoutError:
                self._process.kill()
                await self._process.wait()

    def _exited(self) -> bool:
        return self._process is not None and self._process.returncode is not None

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def accepts(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0
