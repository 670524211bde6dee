"""The CLI against cluster instances: `cluster status --data-dir` of an instance given its admin
token through the environment (as the compose file and Kubernetes do), and the `instance`
column of `esp32-bridge devices`."""

from pathlib import Path

from backend.server import Bridge
from backend.transports.mqtt_credentials import BridgeAccount
from simulator import SimulatedDevice
from testkit.cluster import Cluster, fleet_state, until
from testkit.cluster_processes import ServeInstance, instance_env
from testkit.mosquitto import Mosquitto
from testkit.settings import ADMIN_TOKEN
from tests.cli_helpers import table
from tests.cluster_helpers import cluster, devices, start_device
from tests.helpers import run_cli

# Fixtures shared by the cluster tests (tests/cluster_helpers.py).
__all__ = ["cluster", "devices"]

NO_TOKEN = {"BRIDGE_ADMIN_TOKEN": "", "BRIDGE_SERVER": ""}  # nothing from the CLI's environment


# ---- the admin token of a `serve` given it through its environment ---------------------------


async def test_cluster_status_with_data_dir_finds_the_token_the_serve_was_given(
    tmp_path: Path, postgres_url: str
) -> None:
    account = BridgeAccount("bridge-a")
    broker = Mosquitto(tmp_path / "broker", {}, more_bridges=(account,))
    await broker.start()
    env = instance_env("a", postgres_url, broker.url_of(account))
    instance = ServeInstance("a", tmp_path / "a", env)
    data_dir = ["--data-dir", str(instance.data_dir)]
    try:
        await instance.start()
        assert not (instance.data_dir / "admin.token").exists()  # the token is env-only
        code, out, err = await run_cli("cluster", "status", *data_dir, env=NO_TOKEN)
        assert code == 0, err
        header, rows = table(out)
        assert header[0] == "instance" and rows["a (this)"][0] == "yes"
        code, out, err = await run_cli("devices", *data_dir, env=NO_TOKEN)
        assert (code, out.strip()) == (0, "no devices"), err
        # A wrong token in the CLI's own environment still wins, and the refusal says so.
        code, _out, err = await run_cli(
            "cluster", "status", *data_dir, env={"BRIDGE_ADMIN_TOKEN": "wrong-token"}
        )
        assert code == 1 and "check BRIDGE_ADMIN_TOKEN" in err, err
    finally:
        await instance.stop()
        await broker.stop()
    # Stopped: nothing holds the directory, and the error says how to give a token.
    code, _out, err = await run_cli("cluster", "status", *data_dir, env=NO_TOKEN)
    assert code == 1 and "no admin token: pass --token, set BRIDGE_ADMIN_TOKEN" in err, err


async def test_a_stale_runtime_file_with_a_reused_pid_gives_no_token(tmp_path: Path) -> None:
    """bridge.json and the lock file name a live process (pid 1) but nothing holds the
    directory's lock: that process's environment is not read, and no token is found."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "bridge.lock").write_text("1\n")
    (data_dir / "bridge.json").write_text('{"pid": 1, "api_url": "http://127.0.0.1:9"}\n')
    code, _out, err = await run_cli("cluster", "status", "--data-dir", str(data_dir), env=NO_TOKEN)
    assert code == 1 and "no admin token: pass --token" in err, err


# ---- `devices`: which instance serves each device ----------------------------------------------


async def test_devices_shows_the_instance_serving_each_device(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    on_a = start_device(devices, a.ws_url, 100)
    on_b = start_device(devices, b.ws_url, 101)
    gone = start_device(devices, b.ws_url, 102)
    for bridge, device in ((a, on_a), (b, on_b), (b, gone)):
        await bridge.registry.wait_for_state(device.device_id)
    await gone.stop()
    await until(
        lambda: (
            fleet_state(a, on_b.device_id) == "ready"
            and fleet_state(a, gone.device_id) == "offline"
        ),
        what="a's fleet view",
    )
    code, out, err = await run_cli("devices", "--server", a.api_url, "--token", ADMIN_TOKEN)
    assert code == 0, err
    header, rows = table(out)
    assert header[-1] == "instance"
    assert rows[on_a.device_id][-1] == "a"  # this instance's own device
    assert rows[on_b.device_id][-1] == "b"
    assert rows[gone.device_id][-1] == "-"  # offline: served by none


async def test_devices_of_a_single_bridge_has_no_instance_column(
    bridge: Bridge, devices: list[SimulatedDevice]
) -> None:
    device = start_device(devices, bridge.ws_url, 103)
    await bridge.registry.wait_for_state(device.device_id)
    code, out, err = await run_cli("devices", "--server", bridge.api_url, "--token", ADMIN_TOKEN)
    assert code == 0, err
    header, rows = table(out)
    assert "instance" not in header and device.device_id in rows
