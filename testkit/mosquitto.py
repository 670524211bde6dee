"""A real Mosquitto for tests: its own config, password file and ACL file, on a free loopback port.

Never the broker the machine may already run on 1883: every instance gets a port of its own and a
scratch directory. The password file is written with `mosquitto_passwd` (the real tool), the ACL
file and `mosquitto.conf` (with its `BrokerLimits`) by `backend.transports.mqtt_credentials`, so
the tests exercise what an operator deploys.
"""

import asyncio
import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

from backend.transports.mqtt_credentials import (
    BridgeAccount,
    BrokerLimits,
    mosquitto_acl,
    mosquitto_conf,
    write_mosquitto_password_file,
)
from testkit.ports import reserve_port

START_TIMEOUT_S = 10.0


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port nothing listens on now (a "connection refused" target). A server that binds it
    later takes `testkit.ports.reserve_port` instead: a parallel worker may grab a probed port."""
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _find_broker() -> str | None:
    # Debian installs the broker in /usr/sbin, which is not on every user's PATH.
    return shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/sbin")


def mosquitto_available() -> bool:
    return _find_broker() is not None and shutil.which("mosquitto_passwd") is not None


def _executable() -> str:
    found = _find_broker()
    if found is None:
        raise RuntimeError("mosquitto is not installed (scripts/test installs it)")
    return found


class Mosquitto:
    """One broker process; `start`, `stop` and `restart` keep the same port and files."""

    def __init__(
        self,
        workdir: Path,
        devices: dict[str, str],
        *,
        prefix: str = "xiaozhi",
        bridge: BridgeAccount | None = None,
        limits: BrokerLimits | None = None,
        more_bridges: tuple[BridgeAccount, ...] = (),
        shards: int = 1,
    ) -> None:
        self.workdir = workdir
        self.devices = dict(devices)  # device key -> password
        self.prefix = prefix
        self.bridge = bridge or BridgeAccount()
        # Accounts with the bridge's rights for further instances (a cluster): with
        # use_username_as_clientid two clients of one account would replace each other.
        self.more_bridges = more_bridges
        self.shards = shards
        self.limits = limits or BrokerLimits()
        self.port = reserve_port(self)  # held while this object lives: restarts find it free
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "mosquitto.log"
        self._write_files()

    def _write_files(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        bridges = [self.bridge, *self.more_bridges]
        logins = [(b.username, b.password) for b in bridges] + list(self.devices.items())
        passwords = write_mosquitto_password_file(self.workdir / "passwords", logins, use_tool=True)
        acl = self.workdir / "acl"
        acl.write_text(
            mosquitto_acl(
                self.prefix,
                self.bridge.username,
                more_bridge_usernames=[b.username for b in self.more_bridges],
                shards=self.shards,
            )
        )
        run_as = pwd.getpwuid(os.getuid()).pw_name if os.getuid() == 0 else None
        self.conf = self.workdir / "mosquitto.conf"
        self.conf.write_text(
            mosquitto_conf(
                port=self.port,
                password_file=passwords,
                acl_file=acl,
                run_as=run_as,
                limits=self.limits,
            )
        )

    @property
    def bridge_url(self) -> str:
        return self.url_of(self.bridge)

    def url_of(self, account: BridgeAccount) -> str:
        return f"mqtt://{account.username}:{account.password}@127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def rss_kib(self) -> int:
        """The broker's resident memory (Linux /proc), in KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def log_lines(self) -> int:
        return len(self.log_path.read_text(errors="replace").splitlines())

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _spawn(self) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                [_executable(), "-c", str(self.conf)], stdout=log, stderr=subprocess.STDOUT
            )

    async def start(self) -> None:
        self.process = await asyncio.to_thread(self._spawn)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"mosquitto exited:\n{self.log_path.read_text()}")
            with contextlib.suppress(OSError):
                _reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"mosquitto not accepting on {self.port}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(asyncio.to_thread(process.wait), 10)
        except TimeoutError:
            process.kill()
            await asyncio.to_thread(process.wait)

    async def kill(self) -> None:
        """SIGKILL: the broker vanishes without sending wills or closing connections cleanly."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            await asyncio.to_thread(process.wait)

    async def restart(self) -> None:
        await self.stop()
        await self.start()


@contextlib.asynccontextmanager
async def running_mosquitto(
    workdir: Path, devices: dict[str, str], **kwargs: object
) -> AsyncIterator[Mosquitto]:
    broker = Mosquitto(workdir, devices, **kwargs)  # type: ignore[arg-type]
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()
