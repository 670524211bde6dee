"""deploy/: the files docs/cluster.md tells operators to run, checked without Docker.

- deploy/compose.cluster.yml parses, every `BRIDGE_*` variable names a real setting and the
  bridge services' environments pass the settings' own validation; the services docs/cluster.md
  names are the compose file's; HAProxy's servers are the compose instances on their ports.
- deploy/emqx: the ACL is what `emqx_acl()` writes for the compose file's accounts, and
  deploy/make-secrets.sh seeds exactly those accounts with the passwords the compose file uses.
- deploy/haproxy.cfg runs in a REAL HAProxy in front of two in-process cluster instances, only
  its `bind` and `server` lines rewritten to this test's loopback ports (every other line, the
  mode, balance, health checks, intervals and timeouts, is the committed one): a device comes
  through it, is listed by the other instance, and when its instance drains the health check
  takes that instance out and the device lands on the other one.
"""

import asyncio
import contextlib
import os
import re
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from backend.config import Settings
from backend.devices.registry import DeviceState
from backend.server import Bridge
from backend.transports.mqtt_credentials import emqx_acl
from simulator import SimulatedDevice
from tests.cluster_helpers import Cluster, running_cluster, until
from tests.helpers import DEVICE_TOKEN
from tests.ports import reserve_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.cluster.yml"
HAPROXY_CFG = DEPLOY / "haproxy.cfg"
DOCS = ROOT / "docs" / "cluster.md"

_VARIABLE = re.compile(r"\$\{(?P<name>[A-Z_][A-Z0-9_]*)(?:[:?-][^}]*)?\}")
_SERVER = re.compile(
    r"^(?P<indent>[ \t]*)server[ \t]+(?P<name>\S+)[ \t]+(?P<host>[^\s:]+):(?P<port>\d+)"
    r"(?P<rest>[^\n]*)$",
    re.MULTILINE,
)
_BIND = re.compile(r"^(?P<indent>[ \t]*)bind[ \t]+:(?P<port>\d+)[ \t]*$", re.MULTILINE)
_CHECK_PORT = re.compile(r"\bcheck port (\d+)\b")


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return loaded


def bridge_services() -> dict[str, dict[str, str]]:
    """Each bridge service's environment (a mapping, after YAML anchors)."""
    found = {}
    for name, service in compose()["services"].items():
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        if any(key.startswith("BRIDGE_") for key in environment):
            found[name] = {key: str(value) for key, value in environment.items()}
    return found


def substituted(value: str, fake: dict[str, str]) -> str:
    """`${NAME}` / `${NAME:?message}` as compose would fill them, from `fake`."""
    return _VARIABLE.sub(lambda m: fake[m["name"]], value)


FAKE_ENV = {
    "POSTGRES_PASSWORD": "0123abcd",
    "DEVICE_SECRET": "5eed5eed5eed",
    "BROKER_PASSWORD_A": "a1a1",
    "BROKER_PASSWORD_B": "b2b2",
    "BROKER_PASSWORD_C": "c3c3",
    "PUBLIC_HOST": "bridge.example.lan",
}


# ---- the compose file ---------------------------------------------------------------------------


def test_every_bridge_variable_is_a_real_setting() -> None:
    services = bridge_services()
    assert set(services) == {"bridge-a", "bridge-b", "bridge-c"}
    fields = set(Settings.model_fields)
    for name, environment in services.items():
        unknown = [k for k in environment if k.removeprefix("BRIDGE_").lower() not in fields]
        assert unknown == [], f"{name}: not settings: {unknown}"


def test_each_instance_environment_passes_the_settings_validation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    accounts, secrets = set(), set()
    for name, environment in bridge_services().items():
        for key in [k for k in os.environ if k.startswith("BRIDGE_")]:
            monkeypatch.delenv(key)
        for key, value in environment.items():
            monkeypatch.setenv(key, substituted(value, FAKE_ENV))
        settings = Settings()
        assert settings.instance_id == name
        assert settings.cluster_url is not None and settings.database_url is not None
        assert settings.database_url.startswith("postgresql://")
        broker = urlsplit(settings.cluster_url)
        assert (broker.hostname, broker.port) == ("emqx", 1883)
        accounts.add(broker.username)
        assert settings.http_host == "0.0.0.0"  # HAProxy checks /healthz over the network
        assert settings.lease_renew_s * 2 < settings.lease_ttl_s
        secrets.add(settings.device_secret.get_secret_value() if settings.device_secret else None)
    assert accounts == {"bridge-a", "bridge-b", "bridge-c"}  # one broker account each
    assert secrets == {FAKE_ENV["DEVICE_SECRET"]}  # one device secret for all


def test_every_variable_the_compose_file_needs_is_in_make_secrets() -> None:
    needed = {m["name"] for m in _VARIABLE.finditer(COMPOSE.read_text())}
    assert needed == set(FAKE_ENV)
    written = re.findall(r'echo "([A-Z_]+)=', (DEPLOY / "make-secrets.sh").read_text())
    assert set(written) == needed


def test_the_services_the_docs_name_are_the_compose_services() -> None:
    table = re.search(r"\| service \|.*?\n\n", DOCS.read_text(), re.DOTALL)
    assert table is not None, "docs/cluster.md: the compose services table"
    named = set(re.findall(r"^\| `([a-z0-9-]+)` \|", table.group(0), re.MULTILINE))
    assert named == set(compose()["services"])


def test_the_image_copies_only_what_exists() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    sources = [
        part
        for line in dockerfile.splitlines()
        if line.startswith("COPY ")
        for part in line.split()[1:-1]
    ]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
    kept = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    for source in sources:
        assert f"!{source.rstrip('/')}" in {k.rstrip("/") for k in kept}, source


def test_haproxy_servers_are_the_compose_instances_on_their_ports() -> None:
    services = bridge_services()
    config = HAPROXY_CFG.read_text()
    servers = list(_SERVER.finditer(config))
    assert {m["host"] for m in servers} == set(services)
    ports = {m["port"] for m in servers}
    for m in servers:
        environment = services[m["host"]]
        assert m["port"] in (environment["BRIDGE_WS_PORT"], environment["BRIDGE_DEVICE_HTTP_PORT"])
        check = _CHECK_PORT.search(m["rest"])
        assert check is not None and check.group(1) == environment["BRIDGE_HTTP_PORT"]
    assert len(ports) == 2
    haproxy = compose()["services"]["haproxy"]
    assert "./haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in haproxy["volumes"]
    address = haproxy["networks"]["fleet"]["ipv4_address"]
    for environment in services.values():
        assert f"{address}/32" in environment["BRIDGE_RATE_LIMIT_EXEMPT"]


# ---- EMQX files ---------------------------------------------------------------------------------


def test_the_emqx_acl_is_the_generated_one_for_the_instance_accounts() -> None:
    first, *more = sorted(bridge_services())
    assert (DEPLOY / "emqx" / "acl.conf").read_text() == emqx_acl(
        "xiaozhi", first, more_bridge_usernames=more
    )
    base = (DEPLOY / "emqx" / "base.hocon").read_text()
    mounts = compose()["services"]["emqx"]["volumes"]
    for file in ("acl.conf", "auth-built-in-db-bootstrap.csv"):
        assert f'"${{EMQX_ETC_DIR}}/{file}"' in base
        assert f"./emqx/{file}:/opt/emqx/etc/{file}:ro" in mounts


def test_make_secrets_seeds_the_accounts_the_instances_log_in_with(tmp_path: Path) -> None:
    copy = tmp_path / "deploy"
    (copy / "emqx").mkdir(parents=True)
    shutil.copy(DEPLOY / "make-secrets.sh", copy)
    for _ in range(2):  # the second run leaves both files alone
        subprocess.run(["bash", str(copy / "make-secrets.sh")], check=True, capture_output=True)
    env = dict(
        line.split("=", 1) for line in (copy / ".env").read_text().splitlines() if "=" in line
    )
    accounts = (copy / "emqx" / "auth-built-in-db-bootstrap.csv").read_text().splitlines()
    assert accounts[0] == "user_id,password,is_superuser"
    rows = {row.split(",")[0]: row.split(",")[1] for row in accounts[1:]}
    for name, environment in bridge_services().items():
        url = urlsplit(substituted(environment["BRIDGE_CLUSTER_URL"], env))
        assert rows[url.username or ""] == url.password, name
    assert len(set(rows.values())) == len(rows)  # a password of its own each
    assert oct((copy / ".env").stat().st_mode & 0o777) == "0o600"


# ---- a real HAProxy with the committed configuration -----------------------------------------


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")


needs_haproxy = pytest.mark.skipif(
    haproxy_binary() is None, reason="HAProxy is not installed (scripts/test installs it)"
)


@dataclass(frozen=True)
class InstancePorts:
    """Where one in-process instance listens, by the compose file's port numbers."""

    by_compose_port: dict[str, int]


def instance_ports(bridge: Bridge) -> InstancePorts:
    environment = bridge_services()["bridge-a"]  # every instance uses the same port numbers
    ota_port = urlsplit(bridge.provisioning.ota_url).port
    assert ota_port is not None
    return InstancePorts(
        {
            environment["BRIDGE_WS_PORT"]: bridge.websocket.port,
            environment["BRIDGE_DEVICE_HTTP_PORT"]: ota_port,
            environment["BRIDGE_HTTP_PORT"]: bridge.http_port,
        }
    )


def render(config: str, instances: dict[str, InstancePorts], binds: dict[str, int]) -> str:
    """The committed configuration with its `bind` ports and its `server` addresses replaced by
    this test's; a compose instance the test does not run loses its `server` line."""

    def server(m: re.Match[str]) -> str:
        ports = instances.get(m["name"])
        if ports is None:
            return f"{m['indent']}# {m['name']}: not started by this test"
        rest = _CHECK_PORT.sub(
            lambda c: f"check port {ports.by_compose_port[c.group(1)]}", m["rest"]
        )
        address = f"127.0.0.1:{ports.by_compose_port[m['port']]}"
        return f"{m['indent']}server {m['name']} {address}{rest}"

    def bind(m: re.Match[str]) -> str:
        return f"{m['indent']}bind 127.0.0.1:{binds[m['port']]}"

    rendered = _BIND.sub(bind, _SERVER.sub(server, config))
    assert _SERVER.findall(rendered), "no server left"
    return rendered


class HAProxy:
    """HAProxy in the foreground on a rendered configuration; its log lines in `output`."""

    def __init__(self, config_path: Path) -> None:
        self.config_path = config_path
        self.log_path = config_path.with_suffix(".log")
        self._process: asyncio.subprocess.Process | None = None

    def check(self) -> subprocess.CompletedProcess[str]:
        binary = haproxy_binary()
        assert binary is not None
        return subprocess.run(
            [binary, "-c", "-f", str(self.config_path)], capture_output=True, text=True
        )

    async def start(self, port: int) -> None:
        binary = haproxy_binary()
        assert binary is not None
        with self.log_path.open("wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                binary, "-db", "-f", str(self.config_path), stdout=log, stderr=log
            )
        await until(lambda: _accepts(port) or self._exited(), what="HAProxy listening")
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


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
async def cluster(tmp_path: Path, postgres_url: str) -> AsyncIterator[Cluster]:
    async with running_cluster(tmp_path, postgres_url) as running:
        yield running


@pytest.fixture
def device_list() -> Iterator[list[SimulatedDevice]]:
    started: list[SimulatedDevice] = []
    yield started


@needs_haproxy
async def test_a_device_behind_haproxy_moves_when_its_instance_drains(
    cluster: Cluster, tmp_path: Path, device_list: list[SimulatedDevice]
) -> None:
    bridges = {f"bridge-{name}": await cluster.start(name) for name in "ab"}
    environment = bridge_services()["bridge-a"]
    ws_bind = reserve_port(cluster)
    binds = {
        environment["BRIDGE_WS_PORT"]: ws_bind,
        environment["BRIDGE_DEVICE_HTTP_PORT"]: reserve_port(cluster),
    }
    config_path = tmp_path / "haproxy.cfg"
    config_path.write_text(
        render(
            HAPROXY_CFG.read_text(),
            {name: instance_ports(bridge) for name, bridge in bridges.items()},
            binds,
        )
    )
    haproxy = HAProxy(config_path)
    checked = haproxy.check()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    await haproxy.start(ws_bind)
    device = SimulatedDevice(
        f"ws://127.0.0.1:{ws_bind}/xiaozhi/v1/", DEVICE_TOKEN, index=40, reconnect_min_s=0.2
    )
    device_list.append(device)
    try:
        device.start()
        device_id = device.device_id

        def owner() -> str | None:
            for name, bridge in bridges.items():
                found = bridge.registry.get(device_id)  # live on this instance only
                if found is not None and found.state is DeviceState.READY:
                    return name
            return None

        first = await until(owner, timeout_s=15, what="the device ready on one instance")
        (other,) = set(bridges) - {first}
        await until(
            lambda: _remote_ready(bridges[other], device_id, bridges[first]),
            what="the device listed by the other instance",
        )

        async with cluster.api(first.removeprefix("bridge-")) as api:
            drained = await api.post("/api/cluster/drain")
            assert drained.status_code == 200, drained.text
            assert (await api.get("/healthz")).status_code == 503

        await until(
            lambda: owner() == other,
            timeout_s=30,
            what=f"the device ready on {other} after {first} drained",
        )
        assert len(bridges[first].registry) == 0
        # The health check, not luck, took the drained instance out of both backends.
        await until(
            lambda: all(
                f"{backend}/{first} is DOWN" in haproxy.output
                for backend in ("bridges_ws", "bridges_ota")
            ),
            what="HAProxy marking the drained instance down",
        )
        assert f"{other} is DOWN" not in haproxy.output
    finally:
        with contextlib.suppress(Exception):
            await device.stop()
        await haproxy.stop()


def _remote_ready(bridge: Bridge, device_id: str, owner: Bridge) -> bool:
    assert owner.cluster is not None
    return any(
        remote.device_id == device_id
        and remote.owner == owner.cluster.instance_id
        and remote.state is DeviceState.READY
        for remote in bridge.registry.remote_devices()
    )


@needs_haproxy
def test_haproxy_accepts_the_committed_configuration(tmp_path: Path) -> None:
    """`haproxy -c` on the file as committed, the compose service names resolved to loopback
    (HAProxy resolves server addresses when it reads the file)."""
    config = _SERVER.sub(
        lambda m: f"{m['indent']}server {m['name']} 127.0.0.1:{m['port']}{m['rest']}",
        HAPROXY_CFG.read_text(),
    )
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    checked = HAProxy(path).check()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "mode tcp" in config and "option httpchk GET /healthz" in config
