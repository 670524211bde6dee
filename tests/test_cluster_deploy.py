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
- The same file in front of two `serve` processes: 300 devices from one address (a NAT) all get
  through on their first connection; after `kill -9` of one instance every one of its devices
  gets through to the survivor on its FIRST reconnect (retries + redispatch, not the health
  check), and API requests through the API frontend are redispatched to the survivor.
- deploy/k8s: every manifest passes the Kubernetes JSON schemas (kubernetes-validate, strict),
  a broken copy does not; the StatefulSet names instances after their pods (downward API),
  references its secrets, probes /readyz and /livez and drains in preStop.
"""

import asyncio
import contextlib
import copy
import functools
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from backend.config import Settings
from backend.devices.state import DeviceState
from backend.server import Bridge
from backend.transports.mqtt_credentials import BridgeAccount, emqx_acl
from simulator import SimulatedDevice
from testkit.cluster import Cluster, until
from testkit.cluster_processes import ADMIN_TOKEN as PROCESS_ADMIN_TOKEN
from testkit.cluster_processes import DEVICE_TOKEN as PROCESS_DEVICE_TOKEN
from testkit.cluster_processes import ServeInstance, instance_env, wait_until
from testkit.haproxy import (
    ADMIN_PORT,
    CHECK_PORT,
    HAPROXY_CFG,
    OTA_PORT,
    SERVER,
    WS_PORT,
    HAProxy,
    InstancePorts,
    haproxy_binary,
)
from testkit.mosquitto import Mosquitto
from testkit.ports import reserve_port
from testkit.settings import ADMIN_TOKEN as TEST_ADMIN_TOKEN
from testkit.settings import DEVICE_TOKEN
from tests.cluster_helpers import cluster

# Fixtures shared by the cluster tests (tests/cluster_helpers.py).
__all__ = ["cluster"]

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.cluster.yml"
DOCS = ROOT / "docs" / "cluster.md"

_VARIABLE = re.compile(r"\$\{(?P<name>[A-Z_][A-Z0-9_]*)(?:[:?-][^}]*)?\}")


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
    servers = list(SERVER.finditer(config))
    assert {m["host"] for m in servers} == set(services)
    ports = {m["port"] for m in servers}
    for m in servers:
        environment = services[m["host"]]
        assert (
            environment["BRIDGE_WS_PORT"],
            environment["BRIDGE_DEVICE_HTTP_PORT"],
            environment["BRIDGE_HTTP_PORT"],
        ) == (WS_PORT, OTA_PORT, ADMIN_PORT)
        assert m["port"] in (WS_PORT, OTA_PORT, ADMIN_PORT)
        assert re.search(r"\bcheck\b", m["rest"]), f"{m['name']}:{m['port']} not health-checked"
        check = CHECK_PORT.search(m["rest"])
        checked_port = check.group(1) if check is not None else m["port"]
        assert checked_port == environment["BRIDGE_HTTP_PORT"]  # /readyz is on the admin port
    assert ports == {WS_PORT, OTA_PORT, ADMIN_PORT}  # devices, OTA, and the API frontend
    haproxy = compose()["services"]["haproxy"]
    assert "./haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in haproxy["volumes"]
    published = {str(port).rsplit(":", 1)[-1] for port in haproxy["ports"]}
    bound = set(re.findall(r"^\s*bind :(\d+)\s*$", config, re.MULTILINE))
    assert published == bound == {WS_PORT, OTA_PORT, ADMIN_PORT}  # the API through HAProxy too
    address = haproxy["networks"]["fleet"]["ipv4_address"]
    for environment in services.values():
        assert f"{address}/32" in environment["BRIDGE_RATE_LIMIT_EXEMPT"]


def haproxy_settings() -> dict[str, list[str]]:
    """Each section of the shipped file (`frontend devices_ws`, ...) with its lines."""
    sections: dict[str, list[str]] = {}
    current = ""
    for raw in HAPROXY_CFG.read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line:
            continue
        if not line[0].isspace():
            current = line.strip()
            sections[current] = []
        else:
            sections[current].append(" ".join(line.split()))
    return sections


def test_haproxy_fails_over_without_waiting_for_the_health_check() -> None:
    """What makes a reconnect after `kill -9` land on a live instance at once (measured in
    test_kill_9_behind_the_shipped_haproxy below), and the check interval the drain relies on."""
    sections = haproxy_settings()
    defaults = sections["defaults"]
    assert "retries 2" in defaults and "option redispatch 1" in defaults
    (default_server,) = [line for line in defaults if line.startswith("default-server")]
    assert "inter 2s fall 2" in default_server  # docs/cluster.md, drain: inter x fall
    # A draining instance (503) moves its devices itself, at a bounded rate: HAProxy must not
    # cut them all when its check fails.
    assert not any("shutdown-sessions" in line for lines in sections.values() for line in lines)
    for backend in ("backend bridges_ws", "backend bridges_ota", "backend bridges_api"):
        assert "option httpchk GET /readyz" in sections[backend], backend
    api = sections["backend bridges_api"]
    assert "mode http" in api and "retry-on conn-failure" in api  # never a request twice
    assert "mode http" in sections["frontend api"]


def test_haproxy_per_source_limits_admit_300_devices_behind_one_address() -> None:
    """A NAT with 300 devices: all of them connecting at once, each retrying twice in the
    window, stays under the per-source limits (the 300-device run through HAProxy is below)."""
    for frontend in ("frontend devices_ws", "frontend devices_ota"):
        text = "\n".join(haproxy_settings()[frontend])
        assert "store conn_rate(10s)" in text, frontend
        rates = [int(n) for n in re.findall(r"sc_conn_rate\(0\) gt (\d+)", text)]
        assert rates and min(rates) >= 3 * 300, (frontend, rates)
        currents = [int(n) for n in re.findall(r"sc_conn_cur\(0\) gt (\d+)", text)]
        assert all(limit >= 2 * 300 for limit in currents), (frontend, currents)


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


needs_haproxy = pytest.mark.skipif(
    haproxy_binary() is None, reason="HAProxy is not installed (scripts/test installs it)"
)


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


@pytest.fixture
def device_list() -> Iterator[list[SimulatedDevice]]:
    started: list[SimulatedDevice] = []
    yield started


@needs_haproxy
async def test_a_device_behind_haproxy_moves_when_its_instance_drains(
    cluster: Cluster, tmp_path: Path, device_list: list[SimulatedDevice]
) -> None:
    bridges = {f"bridge-{name}": await cluster.start(name) for name in "ab"}
    await until(lambda: all_ready(bridges), what="both instances ready (joined)")
    ws_bind = reserve_port(cluster)
    binds = {WS_PORT: ws_bind, OTA_PORT: reserve_port(cluster), ADMIN_PORT: reserve_port(cluster)}
    haproxy = HAProxy.shipped(
        tmp_path / "haproxy",
        {name: instance_ports(bridge) for name, bridge in bridges.items()},
        binds,
    )
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
                for backend in ("bridges_ws", "bridges_ota", "bridges_api")
            ),
            what="HAProxy marking the drained instance down",
        )
        assert f"{other} is DOWN" not in haproxy.output
    finally:
        with contextlib.suppress(Exception):
            await device.stop()
        await haproxy.stop()


def all_ready(bridges: dict[str, Bridge]) -> bool:
    """Every instance's readiness is 200 (not draining, fenced or still joining)."""
    return all(b.cluster is not None and b.cluster.health() is None for b in bridges.values())


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
    config = SERVER.sub(
        lambda m: f"{m['indent']}server {m['name']} 127.0.0.1:{m['port']}{m['rest']}",
        HAPROXY_CFG.read_text(),
    )
    path = tmp_path / "haproxy.cfg"
    path.write_text(config)
    checked = HAProxy(path).check()
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "[WARNING]" not in checked.stdout + checked.stderr, checked.stdout + checked.stderr
    assert "mode tcp" in config and "option httpchk GET /readyz" in config


# ---- kill -9 behind the shipped file: `serve` processes, 300 devices from one address --------

NAT_DEVICES = 300  # one site behind one address (every simulated device comes from 127.0.0.1)
FAILOVER_BOUND_S = 5.0  # issue #33: max 5 s (p50 2 s: bench/cluster.py measures it)


class CountedDevice:
    """A simulated device whose WebSocket connection attempts are counted, each with whether
    its upgrade went through (the firmware's `connections` counts only those that did)."""

    def __init__(self, url: str, index: int) -> None:
        self.device = SimulatedDevice(url, PROCESS_DEVICE_TOKEN, index=index, reconnect_min_s=1.0)
        self._upgrades_before: list[int] = []  # app.connections when each attempt began
        factory = self.device.app.transport_factory

        def counting(url: str, headers: Any) -> Any:
            self._upgrades_before.append(self.device.app.connections)
            return factory(url, headers)

        self.device.app.transport_factory = counting

    @property
    def device_id(self) -> str:
        return self.device.device_id

    @property
    def attempts(self) -> int:
        return len(self._upgrades_before)

    def upgraded(self, attempt: int) -> bool | None:
        """Whether attempt number `attempt` (0-based) got through to a bridge (its WebSocket
        upgrade succeeded: HAProxy neither rejected it nor failed to reach an instance);
        None if it has not been made."""
        if attempt >= self.attempts:
            return None
        after = (
            self._upgrades_before[attempt + 1]
            if attempt + 1 < self.attempts
            else self.device.app.connections
        )
        return bool(after > self._upgrades_before[attempt])


def serve_ports(instance: ServeInstance) -> InstancePorts:
    ota_port = urlsplit(str(instance.runtime["ota_url"])).port
    api_port = urlsplit(instance.api_url).port
    assert ota_port is not None and api_port is not None
    return InstancePorts({WS_PORT: instance.ws_port, OTA_PORT: ota_port, ADMIN_PORT: api_port})


@pytest.fixture
async def serve_pair(
    tmp_path: Path, postgres_url: str
) -> AsyncIterator[tuple[dict[str, ServeInstance], HAProxy, dict[str, int]]]:
    """Two `serve` processes (bridge-a, bridge-b) behind the shipped HAProxy file."""
    names = ("bridge-a", "bridge-b")
    accounts = {name: BridgeAccount(name) for name in names}
    broker = Mosquitto(tmp_path / "broker", {}, more_bridges=tuple(accounts.values()))
    await broker.start()
    instances = {
        name: ServeInstance(
            name,
            tmp_path / name,
            # Default leases. Rebalancing off: it sheds devices (close 1012) while the
            # instances' shares settle, which is not the balancer's doing (test_cluster_balance).
            instance_env(
                name, postgres_url, broker.url_of(accounts[name]), cluster_rebalance=False
            ),
        )
        for name in names
    }
    binds = {port: reserve_port(broker) for port in (WS_PORT, OTA_PORT, ADMIN_PORT)}
    haproxy: HAProxy | None = None
    try:
        await asyncio.gather(*(instance.start() for instance in instances.values()))
        for instance in instances.values():  # joined (readiness answers 503 while joining)
            ready = functools.partial(_ready, instance.api_url)
            await wait_until(ready, 30, f"{instance.name} ready")
        haproxy = HAProxy.shipped(
            tmp_path / "haproxy",
            {name: serve_ports(instance) for name, instance in instances.items()},
            binds,
        )
        checked = haproxy.check()
        assert checked.returncode == 0, checked.stdout + checked.stderr
        await haproxy.start(binds[WS_PORT])
        yield instances, haproxy, binds
    finally:
        if haproxy is not None:
            await haproxy.stop()
        for instance in instances.values():
            with contextlib.suppress(Exception):
                await instance.stop()
        await broker.stop()


async def _ready(api_url: str) -> bool:
    async with httpx.AsyncClient(base_url=api_url, timeout=5) as http:
        return (await http.get("/readyz")).status_code == 200


async def ready_owners(api_url: str) -> dict[str, str]:
    """device id -> the instance it is ready on, in the view of the instance at `api_url`."""
    async with httpx.AsyncClient(
        base_url=api_url, headers={"Authorization": f"Bearer {PROCESS_ADMIN_TOKEN}"}, timeout=10
    ) as http:
        page = (await http.get("/api/devices", params={"limit": 1000})).json()
    return {r["device_id"]: r["instance"] for r in page["devices"] if r["state"] == "ready"}


@needs_haproxy
@pytest.mark.serial
async def test_kill_9_behind_the_shipped_haproxy(
    serve_pair: tuple[dict[str, ServeInstance], HAProxy, dict[str, int]],
) -> None:
    """300 devices from one address come online through the shipped file without one refused
    connection; after `kill -9` of an instance every one of its devices is ready on the other
    on its FIRST reconnect (HAProxy retried the refused connection elsewhere: no waiting for
    the health check), and API requests through the API frontend right after the kill are all
    answered, by the survivor."""
    instances, haproxy, binds = serve_pair
    url = f"ws://127.0.0.1:{binds[WS_PORT]}/xiaozhi/v1/"
    api_url = f"http://127.0.0.1:{binds[ADMIN_PORT]}"
    devices = [CountedDevice(url, 600 + i) for i in range(NAT_DEVICES)]
    for each in devices:
        each.device.start()
    try:
        # The API frontend answers (any instance), and every device came online on its first
        # connection: the per-source limits admitted 300 devices from one address at once.
        survivor_view = instances["bridge-a"].api_url

        async def all_online() -> bool:
            return len(await ready_owners(api_url)) == NAT_DEVICES

        await wait_until(all_online, 60, f"{NAT_DEVICES} devices ready through HAProxy")
        refused = [d.device_id for d in devices if not d.upgraded(0)]
        assert refused == [], f"{len(refused)} devices not through on their first connection"
        owners = await ready_owners(survivor_view)
        counts = {name: sum(1 for o in owners.values() if o == name) for name in instances}
        assert all(counts.values()), f"leastconn spreads the devices: {counts}"

        victim_name = max(counts, key=lambda name: counts[name])
        (survivor_name,) = set(instances) - {victim_name}
        survivor = instances[survivor_name]
        moving = [d for d in devices if owners[d.device_id] == victim_name]
        before = {d.device_id: d.attempts for d in moving}

        killed_at = time.monotonic()
        await instances[victim_name].kill()
        # API clients right after the kill, before the health check can notice: each request on
        # a new connection (roundrobin sends every other one to the dead instance first), all
        # answered by the survivor, none refused.
        answered = []
        async with httpx.AsyncClient(
            base_url=api_url,
            headers={"Authorization": f"Bearer {PROCESS_ADMIN_TOKEN}", "Connection": "close"},
            timeout=10,
        ) as http:
            for _ in range(20):
                reply = await http.get("/api/cluster")
                assert reply.status_code == 200, reply.text
                answered.append(reply.json()["instance"])
        assert set(answered) == {survivor_name}
        # ... and HAProxy's log shows why: requests whose connection the dead instance refused
        # were retried on the survivor (`+1` retries), not failed with a 503. (Unless a health
        # check that was under way when the process died took it out first, which happens.)
        checked_out = re.compile(rf"bridges_api/{victim_name} is DOWN, reason: (?!Health analyze)")
        if not checked_out.search(haproxy.output):
            redispatched = re.compile(r" api bridges_api/\S+ .* 200 .* \d+/\d+/\d+/\d+/\+[12] ")
            await until(
                lambda: redispatched.search(haproxy.output),
                what="a redispatched API request logged",
            )

        moving_ids = {d.device_id for d in moving}

        async def moved() -> bool:
            owners = await ready_owners(survivor.api_url)
            return all(owners.get(device_id) == survivor_name for device_id in moving_ids)

        await wait_until(moved, 30, f"{victim_name}'s devices ready on {survivor_name}")
        failover_s = time.monotonic() - killed_at
        # Each device's first attempt after the kill got through, to the survivor (HAProxy
        # retried the refused connection there). Later closes by the bridge itself are not
        # the balancer's doing and not counted here.
        missed = [d.device_id for d in moving if not d.upgraded(before[d.device_id])]
        assert missed == [], f"{len(missed)} of {len(moving)} not through on the first reconnect"
        assert failover_s < FAILOVER_BOUND_S, f"failover took {failover_s:.2f} s"
        # Not the health check: it had not even taken the dead instance out when they moved,
        # or, if it had, only after the devices' first reconnects had all succeeded.
        assert f"{survivor_name} is DOWN" not in haproxy.output
    finally:
        await asyncio.gather(*(d.device.stop() for d in devices), return_exceptions=True)


# ---- Kubernetes manifests (deploy/k8s) ----------------------------------------------------------

K8S = DEPLOY / "k8s"
K8S_VERSIONS = ("1.27", "1.37")  # the oldest Kubernetes these manifests claim, and the newest
# kubernetes-validate ships schemas for
POD_NAME = "esp32-bridge-0"


def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def k8s_resources() -> list[dict[str, Any]]:
    return [doc for path in k8s_files() for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_validate(resource: dict[str, Any]) -> None:
    """Raise kubernetes_validate.ValidationError unless `resource` passes the Kubernetes JSON
    schema of every version in K8S_VERSIONS, strictly (no field the schema does not know)."""
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(resource, version, strict=True)


def k8s_one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        r
        for r in k8s_resources()
        if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def test_every_k8s_manifest_passes_the_kubernetes_schema() -> None:
    resources = k8s_resources()
    assert {r["kind"] for r in resources} >= {
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "PersistentVolumeClaim",
    }
    for resource in resources:
        k8s_validate(resource)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in k8s_files())


def _misspelt_probe(resource: dict[str, Any]) -> None:
    container = resource["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")


def _replicas_as_words(resource: dict[str, Any]) -> None:
    resource["spec"]["replicas"] = "three"


def _no_selector(resource: dict[str, Any]) -> None:
    del resource["spec"]["selector"]


def _env_without_name(resource: dict[str, Any]) -> None:
    del resource["spec"]["template"]["spec"]["containers"][0]["env"][0]["name"]


@pytest.mark.parametrize(
    "breakage", [_misspelt_probe, _replicas_as_words, _no_selector, _env_without_name]
)
def test_the_schema_check_rejects_a_broken_manifest(breakage: Any) -> None:
    """The validator is not a rubber stamp: a wrong copy of the StatefulSet fails it."""
    broken = copy.deepcopy(k8s_one("StatefulSet"))
    breakage(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(broken)


def _container(statefulset: dict[str, Any]) -> dict[str, Any]:
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = container
    return found


def test_the_statefulset_names_instances_after_their_pods_and_reads_secrets_by_reference(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    statefulset = k8s_one("StatefulSet")
    container = _container(statefulset)
    env = {item["name"]: item for item in container["env"]}
    fields = set(Settings.model_fields)
    assert [k for k in env if k.removeprefix("BRIDGE_").lower() not in fields] == []
    assert env["BRIDGE_INSTANCE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    for name in ("BRIDGE_DATABASE_URL", "BRIDGE_DEVICE_SECRET", "BRIDGE_ADMIN_TOKEN"):
        assert "value" not in env[name] and "secretKeyRef" in env[name]["valueFrom"], name
    assert not any(r["kind"] == "Secret" for r in k8s_resources())  # referenced, never inlined
    # The cluster URL (this instance's own broker account) comes from the Secret key named like
    # the pod, read by the start command.
    script = " ".join(container["args"])
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
    assert f"{mounts['cluster-urls']}/$BRIDGE_INSTANCE_ID" in script
    assert volumes["cluster-urls"]["secret"]["secretName"] == "esp32-bridge-cluster-urls"
    assert "exec esp32-bridge serve" in script
    urls = tmp_path / "cluster-urls"
    urls.mkdir()
    (urls / POD_NAME).write_text(f"mqtt://{POD_NAME}:pw@emqx:1883")
    runnable = script.replace(mounts["cluster-urls"], str(urls)).replace(
        "exec esp32-bridge serve", "exec printenv BRIDGE_CLUSTER_URL"
    )
    for pod, expected in ((POD_NAME, 0), ("esp32-bridge-7", 1)):  # no key: the pod fails
        ran = subprocess.run(
            ["sh", "-c", runnable],
            env={"PATH": os.environ["PATH"], "BRIDGE_INSTANCE_ID": pod},
            capture_output=True,
            text=True,
        )
        assert ran.returncode == expected, ran.stderr
        assert ran.stdout.strip() == ("" if expected else f"mqtt://{POD_NAME}:pw@emqx:1883")

    # The environment a pod gets passes the settings' validation, instance id = pod name.
    for key in [k for k in os.environ if k.startswith("BRIDGE_")]:
        monkeypatch.delenv(key)
    fake = {
        "database-url": "postgresql://bridge:pw@postgres:5432/bridge",
        "device-secret": "5eed5eed5eed",
        "admin-token": "a" * 40,
    }
    for name, item in env.items():
        if "value" in item:
            monkeypatch.setenv(name, item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            monkeypatch.setenv(name, fake[item["valueFrom"]["secretKeyRef"]["key"]])
        else:
            monkeypatch.setenv(name, POD_NAME)
    monkeypatch.setenv("BRIDGE_CLUSTER_URL", f"mqtt://{POD_NAME}:pw@emqx:1883")
    settings = Settings()
    assert settings.instance_id == POD_NAME
    assert settings.http_host == "0.0.0.0"


def test_the_statefulset_probes_drains_and_is_governed_by_a_headless_service() -> None:
    statefulset = k8s_one("StatefulSet")
    container = _container(statefulset)
    env = {item["name"]: item.get("value") for item in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "ws": int(env["BRIDGE_WS_PORT"] or 0),
        "ota": int(env["BRIDGE_DEVICE_HTTP_PORT"] or 0),
        "admin": int(env["BRIDGE_HTTP_PORT"] or 0),
    }
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "admin"}
    # The drain waits at least as long as the readiness probe needs to notice.
    readiness = container["readinessProbe"]
    noticed_s = readiness["periodSeconds"] * readiness["failureThreshold"]
    assert float(env["BRIDGE_DRAIN_NOTICE_S"] or 0) >= noticed_s
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["esp32-bridge", "cluster", "drain"]
    assert command[command.index("--server") + 1] == f"http://127.0.0.1:{ports['admin']}"
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 30

    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert statefulset["spec"]["selector"]["matchLabels"] == labels
    headless = k8s_one("Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    pdb = k8s_one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == labels
    assert pdb["spec"]["maxUnavailable"] == 1

    # A Service for the devices (WebSocket + OTA) and one for the API, on the named ports.
    devices = k8s_one("Service", "esp32-bridge-devices")
    api = k8s_one("Service", "esp32-bridge-api")
    for service in (devices, api, headless):
        assert service["spec"]["selector"] == labels
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, port
    assert {p["targetPort"] for p in devices["spec"]["ports"]} == {"ws", "ota"}
    assert {p["targetPort"] for p in api["spec"]["ports"]} == {"admin"}
    claim = statefulset["spec"]["template"]["spec"]["volumes"][0]
    k8s_one("PersistentVolumeClaim", claim["persistentVolumeClaim"]["claimName"])


@needs_haproxy
async def test_an_mcp_session_through_the_api_frontend_stays_on_its_instance(
    cluster: Cluster, tmp_path: Path
) -> None:
    """/mcp sessions live in the instance that opened them: the API frontend balances requests
    round-robin, yet every request of a session reaches its instance (the stick table on
    Mcp-Session-Id), while requests without a session are spread over both."""
    bridges = {f"bridge-{name}": await cluster.start(name) for name in "ab"}
    await until(lambda: all_ready(bridges), what="both instances ready (joined)")
    api_bind = reserve_port(cluster)
    binds = {WS_PORT: reserve_port(cluster), OTA_PORT: reserve_port(cluster), ADMIN_PORT: api_bind}
    haproxy = HAProxy.shipped(
        tmp_path / "haproxy",
        {name: instance_ports(bridge) for name, bridge in bridges.items()},
        binds,
    )
    await haproxy.start(api_bind)
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "probe", "version": "1"},
        },
    }
    headers = {
        "Authorization": f"Bearer {TEST_ADMIN_TOKEN}",
        "Accept": "application/json, text/event-stream",
    }
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{api_bind}", headers=headers, timeout=10
        ) as http:
            sessions = []
            for _ in range(2):  # round-robin: one session opened on each instance
                opened = await http.post("/mcp", json=initialize)
                assert opened.status_code == 200, opened.text
                sessions.append(opened.headers["mcp-session-id"])
            for session in sessions:  # consecutive requests of one session: round-robin alone
                for number in range(4):  # would alternate instances
                    listing = {"jsonrpc": "2.0", "id": 2 + number, "method": "tools/list"}
                    reply = await http.post(
                        "/mcp", json=listing, headers={"mcp-session-id": session}
                    )
                    assert reply.status_code == 200, (number, reply.status_code, reply.text)
            answered = {(await http.get("/api/cluster")).json()["instance"] for _ in range(4)}
            assert answered == {"a", "b"}  # without a session: spread over both
    finally:
        await haproxy.stop()
