"""Three bridge instances on one PostgreSQL and one Mosquitto: leases, the fleet view, forwarded
calls with the same results and errors as local ones, stale links, drain, an instance leaving.

The instances run in this process (each a real `Bridge` with its own listeners, database pool
and broker connection); tests/test_cluster_processes.py kills real processes."""

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from backend.devices.device import RemoteDevice
from backend.devices.state import DeviceState
from backend.server import Bridge
from simulator import SimulatedDevice
from testkit.cluster import Cluster, Partition, until
from testkit.llm_server import FakeCall, FakeLlm, Reply
from testkit.settings import ADMIN_TOKEN, make_settings
from tests.cli_helpers import table
from tests.cluster_helpers import cluster, devices, start_device
from tests.helpers import run_cli
from tests.mcp_helpers import VOLUME as MCP_VOLUME
from tests.mcp_helpers import mcp_session
from tests.stream_helpers import open_stream, stream_state
from tests.stream_helpers import stream_ready as ready_event

# Fixtures shared by the cluster tests (tests/cluster_helpers.py).
__all__ = ["cluster", "devices"]


def state_on(cluster: Cluster, name: str, device_id: str) -> str | None:
    found = cluster.bridges[name].registry._live.get(device_id) or cluster.bridges[
        name
    ].registry._remote.get(device_id)
    return None if found is None else found.state.value


async def test_a_call_through_any_instance_reaches_a_device_on_another(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a, _b, c = [await cluster.start(name) for name in "abc"]
    device = start_device(devices, c.ws_url, 1)
    await c.registry.wait_for_state(device.device_id)
    for name in "ab":
        await until(
            lambda n=name: state_on(cluster, n, device.device_id) == "ready",
            what=f"the device ready in {name}'s fleet view",
        )
    remote = a.registry.require(device.device_id)
    assert isinstance(remote, RemoteDevice) and remote.owner == "c"
    assert len(remote.tools) == len(c.registry.require(device.device_id).tools)

    async with cluster.api("a") as api:
        listed = (await api.get("/api/devices")).json()["devices"]
        assert [(d["device_id"], d["state"], d["instance"]) for d in listed] == [
            (device.device_id, "ready", "c")
        ]
        reply = await api.post(
            f"/api/devices/{device.device_id}/tools/call",
            json={"name": "self.audio_speaker.set_volume", "arguments": {"volume": 37}},
        )
    assert reply.status_code == 200, reply.text
    assert device.hal.volume == 37  # the real firmware on the device changed
    assert cluster.bridges["c"].cluster.counters["served"] == 1  # type: ignore[union-attr]
    assert cluster.bridges["a"].cluster.counters["forwarded"] == 1  # type: ignore[union-attr]


async def test_forwarded_errors_are_the_local_ones(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    await cluster.start("a")
    b = await cluster.start("b")
    device = start_device(devices, b.ws_url, 2, extra_tools=2)
    await b.registry.wait_for_state(device.device_id)
    await until(lambda: state_on(cluster, "a", device.device_id) == "ready")
    url = f"/api/devices/{device.device_id}/tools/call"
    cases = [
        # caught on the caller's instance (validation) or on the owner's (the device's deadline)
        ({"name": "self.audio_speaker.set_volum", "arguments": {"volume": 1}}, 404),
        ({"name": "self.audio_speaker.set_volume", "arguments": {"volume": "loud"}}, 422),
        ({"name": "self.reboot"}, 428),
        ({"name": "sim.synthetic_000", "arguments": {"value": 1, "delay_ms": 3000},
          "timeout_s": 0.3}, 504),
        ({"name": "sim.synthetic_000", "arguments": {"value": 1}}, 200),
    ]  # fmt: skip
    async with cluster.api("a") as via_a, cluster.api("b") as via_b:
        for body, status in cases:
            forwarded = await via_a.post(url, json=body)
            local = await via_b.post(url, json=body)
            assert (forwarded.status_code, local.status_code) == (status, status), body
            if status == 200:
                assert forwarded.json()["content"] == local.json()["content"]
                continue
            assert forwarded.json()["error"] == local.json()["error"], body


async def test_a_device_that_reconnects_elsewhere_moves_and_its_stale_link_closes(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    first = start_device(devices, a.ws_url, 3)
    await a.registry.wait_for_state(first.device_id)
    epoch_a = a.cluster._epochs[first.device_id]  # type: ignore[union-attr]
    # The same device id connects to b while its link to a is still open (a half-open link, or
    # the device rebooted): b takes the lease, a closes its link.
    second = start_device(devices, b.ws_url, 3)
    await b.registry.wait_for_state(second.device_id)
    await until(lambda: a.registry.get(first.device_id) is None, what="a closed its stale link")
    assert b.cluster._epochs[second.device_id] > epoch_a  # type: ignore[union-attr]
    await until(lambda: state_on(cluster, "a", first.device_id) == "ready")
    leases = await b.cluster.leases.leases()  # type: ignore[union-attr]
    assert [(lease.device_id, lease.instance_id) for lease in leases] == [(first.device_id, "b")]


async def test_an_instance_that_leaves_takes_its_devices_out_of_every_fleet_view(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    device = start_device(devices, b.ws_url, 4)
    await b.registry.wait_for_state(device.device_id)
    await until(lambda: state_on(cluster, "a", device.device_id) == "ready")
    await cluster.stop("b")
    await until(lambda: state_on(cluster, "a", device.device_id) is None, what="offline on a")
    summary = a.registry.summary(device.device_id)
    assert summary["state"] == "offline" and summary["instance"] is None
    assert await a.cluster.leases.leases() == []  # type: ignore[union-attr]


async def test_a_late_instance_learns_the_fleet_at_join(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    ids = []
    for index in range(5, 10):
        device = start_device(devices, a.ws_url, index)
        ids.append(device.device_id)
    for device_id in ids:
        await a.registry.wait_for_state(device_id)
    c = await cluster.start("c")
    await until(
        lambda: sorted(d.device_id for d in c.registry.remote_devices()) == sorted(ids),
        what="c's fleet view after its join",
    )
    async with cluster.api("c") as api:
        page = (await api.get("/api/devices", params={"state": "ready"})).json()
    assert page["total"] == 5 and {d["instance"] for d in page["devices"]} == {"a"}


async def test_drain_sends_devices_to_another_instance(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    lb = cluster.balancer
    ids = [start_device(devices, lb.url, index).device_id for index in range(10, 16)]
    await until(lambda: all(state_on(cluster, "a", i) == "ready" for i in ids), what="all ready")
    async with cluster.api("a") as api:
        drained = await api.post("/api/cluster/drain")
        health = await api.get("/healthz")
    assert drained.status_code == 200
    assert health.status_code == 503 and health.json()["error"]["message"] == "draining"
    await until(
        lambda: all(
            b.registry.get(i) is not None and b.registry.get(i).state is DeviceState.READY  # type: ignore[union-attr]
            for i in ids
        ),
        timeout_s=20,
        what="every device ready on b",
    )
    assert len(a.registry) == 0
    async with cluster.api("b") as api:
        status = (await api.get("/api/cluster")).json()
    rows = {row["instance_id"]: row for row in status["instances"]}
    assert rows["a"]["draining"] and rows["a"]["devices"] == 0
    assert rows["b"]["devices"] == len(ids) and rows["b"]["alive"]


async def test_in_flight_forwarded_calls_fail_at_once_when_the_owner_leaves(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    device = start_device(devices, b.ws_url, 20, extra_tools=1)
    await b.registry.wait_for_state(device.device_id)
    await until(lambda: state_on(cluster, "a", device.device_id) == "ready")
    remote = a.registry.require(device.device_id)
    call = asyncio.create_task(
        remote.call_tool("sim.synthetic_000", {"value": 1, "delay_ms": 20000}, timeout_s=30)
    )
    await until(lambda: b.cluster._serving, what="the call reached b")  # type: ignore[union-attr]
    await cluster.stop("b")
    async with asyncio.timeout(5):  # not the call's 30 s
        with pytest.raises(Exception) as raised:
            await call
    assert type(raised.value).__name__ == "DeviceDisconnected"
    assert "b" in str(raised.value)


# ---- partitions ---------------------------------------------------------------------------------


async def test_an_instance_cut_off_from_the_broker_keeps_its_devices_and_rejoins_the_view(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    proxy = Partition(port=cluster.broker.port)
    await proxy.start()
    try:
        await cluster.start("a")
        account = cluster.accounts["b"]
        b = await cluster.start(
            "b", cluster_url=f"mqtt://{account.username}:{account.password}@127.0.0.1:{proxy.port}"
        )
        device = start_device(devices, b.ws_url, 40)
        await b.registry.wait_for_state(device.device_id)
        await until(lambda: state_on(cluster, "a", device.device_id) == "ready")
        proxy.cut("refuse")
        # The broker publishes b's will: a takes b's devices out of its view; b still serves them.
        await until(lambda: state_on(cluster, "a", device.device_id) is None, what="offline on a")
        async with cluster.api("a") as via_a, cluster.api("b") as via_b:
            body = {"name": "self.audio_speaker.set_volume", "arguments": {"volume": 11}}
            url = f"/api/devices/{device.device_id}/tools/call"
            refused = await via_a.post(url, json=body)
            served = await via_b.post(url, json=body)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "device_offline"
        assert served.status_code == 200 and device.hal.volume == 11
        assert b.cluster is not None and not b.cluster.fenced  # its leases are still renewed
        proxy.heal()
        await until(lambda: state_on(cluster, "a", device.device_id) == "ready", timeout_s=15,
                    what="back in a's view after the broker returns")  # fmt: skip
        async with cluster.api("a") as via_a:
            body["arguments"] = {"volume": 12}
            assert (await via_a.post(url, json=body)).status_code == 200
        assert device.hal.volume == 12
    finally:
        await proxy.stop()


# ---- the chat on one instance, the device on another ------------------------------------------


async def test_a_chat_turn_on_a_uses_a_device_on_c_through_the_openai_client(
    cluster: Cluster, devices: list[SimulatedDevice], fake_llm: FakeLlm
) -> None:
    llm = {"llm_provider": "openai", "llm_base_url": fake_llm.url}
    a = await cluster.start("a", **llm)
    await cluster.start("b", **llm)
    c = await cluster.start("c", **llm)
    device = start_device(devices, c.ws_url, 50)
    await c.registry.wait_for_state(device.device_id)
    await until(lambda: state_on(cluster, "a", device.device_id) == "ready")
    fake_llm.script(
        "chat",
        Reply(calls=[FakeCall("self_audio_speaker_set_volume", {"volume": 23})]),
        Reply("The volume is now 23."),
    )
    client = openai.AsyncOpenAI(base_url=a.api_url + "/v1", api_key=ADMIN_TOKEN)
    try:
        completion = await client.chat.completions.create(
            model="dental-duckduckgo",
            messages=[{"role": "user", "content": "Set the volume to 23"}],
            extra_body={"device_id": device.device_id},
        )
    finally:
        await client.close()
    assert completion.choices[0].message.content == "The volume is now 23."
    assert device.hal.get_volume() == 23  # the firmware on the device connected to c
    assert c.cluster is not None and c.cluster.counters["served"] == 1
    # The model was offered the device's tools on a, read from c's fleet event.
    offered = {t["function"]["name"] for t in fake_llm.of_kind("chat")[0].body["tools"]}
    assert "self_audio_speaker_set_volume" in offered
    # The owner audits the call once; the caller's instance does not write a second row.
    await c.audit.flush()
    await a.audit.flush()
    rows = await a.database.fetchall("SELECT actor, tool, outcome FROM audit_log")
    assert [(row[1], row[2]) for row in rows] == [("self.audio_speaker.set_volume", "ok")]


# ---- operations -------------------------------------------------------------------------------


async def test_cluster_status_and_drain_from_the_cli(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    device = start_device(devices, b.ws_url, 60)
    await b.registry.wait_for_state(device.device_id)
    await until(lambda: state_on(cluster, "a", device.device_id) == "ready")
    login = ["--server", a.api_url, "--token", ADMIN_TOKEN]
    code, out, err = await run_cli("cluster", "status", *login)
    assert code == 0, err
    _header, cells = table(out)
    assert cells["a (this)"][:4] == ["yes", "", cells["a (this)"][2], "0"]
    assert cells["b"][0] == "yes" and cells["b"][3] == "1" and cells["b"][5] == b.api_url
    assert "1 on the others" in out
    code, out, err = await run_cli("cluster", "status", "--json", *login)
    status = json.loads(out)
    assert {i["instance_id"]: i["devices"] for i in status["instances"]} == {"a": 0, "b": 1}
    code, out, err = await run_cli(
        "cluster", "drain", "--server", b.api_url, "--token", ADMIN_TOKEN
    )
    assert code == 0 and "instance b draining: 1 devices told to reconnect" in out, out + err
    await until(lambda: b.registry.get(device.device_id) is None, what="b dropped the device")
    status = json.loads((await run_cli("cluster", "status", "--json", *login))[1])
    assert {i["instance_id"]: i["draining"] for i in status["instances"]} == {"a": False, "b": True}


async def test_a_single_bridge_says_it_is_not_in_a_cluster(bridge: Bridge) -> None:
    login = ["--server", bridge.api_url, "--token", ADMIN_TOKEN]
    code, out, _err = await run_cli("cluster", "status", *login)
    assert code == 0 and "not in a cluster" in out
    code, out, err = await run_cli("cluster", "drain", *login)
    assert code == 1 and "not in a cluster" in out + err
    assert bridge.registry.instance_id is None


@pytest.mark.parametrize("name", ["up", "down", "status", "bad/name", ""])
def test_instance_ids_that_could_be_topic_levels_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="instance_id"):
        make_settings(tmp_path, instance_id=name)


# ---- every front end sees the whole fleet -------------------------------------------------------


async def test_the_fleet_stream_on_a_shows_a_device_of_b_come_and_go(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    async with open_stream(a, ADMIN_TOKEN) as stream:
        await ready_event(stream)
        device = start_device(devices, b.ws_url, 70)
        await until(lambda: stream_state(stream, device.device_id) == "ready", what="ready row")
        assert stream.rows()[device.device_id]["instance"] == "b"
        await device.stop()
        await until(lambda: stream_state(stream, device.device_id) == "offline", what="offline")


async def test_mcp_on_a_lists_and_calls_the_tools_of_a_device_on_b(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    device = start_device(devices, b.ws_url, 1)
    await b.registry.wait_for_state(device.device_id)
    await until(lambda: state_on(cluster, "a", device.device_id) == "ready")
    async with mcp_session(a, ADMIN_TOKEN) as session:
        tools = {tool.name for tool in (await session.list_tools()).tools}
        assert MCP_VOLUME in tools
        result = await session.call_tool(MCP_VOLUME, {"volume": 29})
    assert not result.is_error and device.hal.get_volume() == 29


async def test_a_cancelled_caller_cancels_the_call_on_the_owner(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    device = start_device(devices, b.ws_url, 71, extra_tools=1)
    await b.registry.wait_for_state(device.device_id)
    await until(lambda: state_on(cluster, "a", device.device_id) == "ready")
    call = asyncio.create_task(
        a.registry.require(device.device_id).call_tool(
            "sim.synthetic_000", {"value": 1, "delay_ms": 20000}, timeout_s=30
        )
    )
    local = b.registry.require(device.device_id)
    await until(lambda: local.mcp.pending_count == 1, what="the call pending on b's link")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await until(lambda: local.mcp.pending_count == 0, what="b cancelled its device call")
    assert not b.cluster._serving  # type: ignore[union-attr]


async def test_a_tool_list_too_long_for_a_message_is_read_from_the_catalogue(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    device = start_device(devices, b.ws_url, 90, extra_tools=80)  # tools/list: several pages
    local = await b.registry.wait_for_state(device.device_id)
    assert len(json.dumps(local.tools.to_wire())) > 16 * 1024
    await until(
        lambda: (
            (remote := a.registry.remote(device.device_id)) is not None
            and len(remote.tools) == len(local.tools)
        ),
        what="the long tool list in a's view",
    )
    result = await a.registry.require(device.device_id).call_tool("sim.synthetic_079", {"value": 7})
    assert not result.is_error, result


async def test_a_burst_of_devices_reaches_the_other_instances_whole(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    await cluster.start("a")
    b = await cluster.start("b")
    ids = [start_device(devices, b.ws_url, 200 + i).device_id for i in range(60)]
    await until(
        lambda: all(state_on(cluster, "a", i) == "ready" for i in ids),
        timeout_s=30,
        what="60 devices of b ready in a's view",
    )
    c = await cluster.start("c")  # and a late instance learns them from the join snapshot
    await until(lambda: all(state_on(cluster, "c", i) == "ready" for i in ids), timeout_s=30)
    assert len(c.registry.remote(ids[-1]).tools) > 0  # type: ignore[union-attr]


# ---- joining and leaving without failing a call -----------------------------------------------


async def test_a_joining_instance_is_ready_once_its_peers_sent_their_devices(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    a = await cluster.start("a")
    device = start_device(devices, a.ws_url, 90)
    await a.registry.wait_for_state(device.device_id)
    a_health: list[str | None] = []
    sampling = asyncio.create_task(_sample(lambda: a.cluster.health(), a_health))  # type: ignore[union-attr]
    b = await cluster.start("b")  # returns once b's /readyz would answer 200
    sampling.cancel()
    assert b.cluster is not None and b.cluster._synced_from == {"a"}
    assert state_on(cluster, "b", device.device_id) == "ready"  # known before it is ready
    assert set(a_health) == {None}  # a newcomer does not make the others unready


async def test_a_stopping_instance_finishes_the_calls_forwarded_to_it(
    cluster: Cluster, devices: list[SimulatedDevice]
) -> None:
    await cluster.start("a")
    b = await cluster.start("b")
    device = start_device(devices, b.ws_url, 91, extra_tools=1)
    await b.registry.wait_for_state(device.device_id)
    await until(lambda: state_on(cluster, "a", device.device_id) == "ready")
    async with cluster.api("a") as api:
        call = asyncio.create_task(
            api.post(
                f"/api/devices/{device.device_id}/tools/call",
                json={"name": "sim.synthetic_000", "arguments": {"value": 7, "delay_ms": 1500}},
            )
        )
        await until(lambda: b.cluster._serving, what="b serving the call")  # type: ignore[union-attr]
        await cluster.stop("b")
        reply = await call
    assert reply.status_code == 200, reply.text


async def _sample(read: Callable[[], Any], into: list[Any]) -> None:
    while True:
        into.append(read())
        await asyncio.sleep(0.005)
