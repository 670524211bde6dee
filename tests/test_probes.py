"""The admin API's probes: `/livez` (liveness: the process and its event loop answer, whatever
the database or the broker do), `/readyz` (readiness: 503 while the instance should get no new
devices) and `/healthz`, the alias of `/readyz`. All three need no token and tell no secret."""

import asyncio
from collections.abc import Awaitable, Callable

import httpx

from backend.api.app import create_app
from backend.devices import DeviceRegistry
from backend.server import Bridge
from simulator import SimulatedDevice
from testkit.cluster import Cluster, Partition, until
from testkit.settings import ADMIN_TOKEN, DEVICE_TOKEN
from tests.cluster_helpers import cluster, database_proxy

# Fixtures shared by the cluster tests (tests/cluster_helpers.py).
__all__ = ["cluster", "database_proxy"]

PROBES = ("/livez", "/readyz", "/healthz")


async def poll(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Await `check()` every 50 ms until true (AssertionError after `timeout_s`)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():  # noqa: ASYNC110 - the state is in another instance
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def probe(client: httpx.AsyncClient) -> dict[str, tuple[int, dict[str, object]]]:
    answers = {path: await client.get(path) for path in PROBES}
    return {path: (answer.status_code, answer.json()) for path, answer in answers.items()}


async def test_the_probes_of_a_single_bridge_need_no_token_and_say_ok(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url) as client:
        answers = await probe(client)
        wrong = await client.get("/readyz", headers={"Authorization": "Bearer wrong"})
    assert answers["/livez"] == (200, {"status": "ok"})
    assert answers["/readyz"] == (200, {"status": "ok", "devices": 0, "known_devices": 0})
    assert answers["/healthz"] == answers["/readyz"]
    assert wrong.status_code == 200  # a probe ignores a token it does not need
    text = str(answers)
    assert ADMIN_TOKEN not in text and DEVICE_TOKEN not in text


async def test_readiness_follows_health_and_liveness_does_not() -> None:
    problem: list[str] = []
    app = create_app(DeviceRegistry(), ADMIN_TOKEN, health=lambda: problem[0] if problem else None)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bridge") as client:
        assert {
            path: status for path, (status, _) in (await probe(client)).items()
        } == dict.fromkeys(PROBES, 200)
        problem.append("cut off from the database")
        answers = await probe(client)
    assert answers["/livez"] == (200, {"status": "ok"})
    for path in ("/readyz", "/healthz"):
        status, body = answers[path]
        assert status == 503, path
        assert body["error"] == {  # the API's one error shape
            "message": "cut off from the database",
            "type": "server_error",
            "param": None,
            "code": "unavailable",
        }


async def test_the_openapi_document_lists_the_probes_as_open(bridge: Bridge) -> None:
    async with httpx.AsyncClient(base_url=bridge.api_url) as client:
        paths = (await client.get("/openapi.json")).json()["paths"]
    for path in PROBES:
        operation = paths[path]["get"]
        assert "security" not in operation, path
        assert "401" not in operation["responses"], path
    assert "503" in paths["/readyz"]["get"]["responses"]
    assert "503" not in paths["/livez"]["get"]["responses"]


# ---- a cluster instance ------------------------------------------------------------------------


def through(proxy: Partition, postgres_url: str) -> str:
    database = postgres_url.split("@/", 1)[1].split("?", 1)[0]
    return f"postgresql://bridge@127.0.0.1:{proxy.port}/{database}"


async def test_a_fenced_instance_is_not_ready_but_alive_and_ready_again_after(
    cluster: Cluster, database_proxy: Partition, postgres_url: str
) -> None:
    """Cut off from the database and the broker, an instance cannot tell whether it still owns
    its devices: it fences, `/readyz` and `/healthz` answer 503, `/livez` stays 200 all along (a
    liveness probe must not restart it for an outage of something else)."""
    broker_proxy = Partition(port=cluster.broker.port)
    await broker_proxy.start()
    try:
        await cluster.start("a")
        account = cluster.accounts["b"]
        b = await cluster.start(
            "b",
            database_url=through(database_proxy, postgres_url),
            cluster_url=f"mqtt://{account.username}:{account.password}@127.0.0.1:{broker_proxy.port}",
        )
        assert b.cluster is not None
        device = SimulatedDevice(b.ws_url, DEVICE_TOKEN, index=90, reconnect_min_s=0.2)
        device.start()
        try:
            await b.registry.wait_for_state(device.device_id)
            async with httpx.AsyncClient(base_url=b.api_url, timeout=5) as client:
                answers = await probe(client)
                assert answers["/readyz"][1]["devices"] == 1
                database_proxy.cut("refuse")
                broker_proxy.cut("refuse")
                lively: list[int] = []

                async def fenced() -> bool:
                    lively.append((await client.get("/livez")).status_code)
                    return b.cluster is not None and b.cluster.fenced

                await poll(fenced, 20, "b fenced")
                answers = await probe(client)
                assert set(lively) == {200} and answers["/livez"] == (200, {"status": "ok"})
                for path in ("/readyz", "/healthz"):
                    assert answers[path][0] == 503, (path, answers[path])
                    assert answers[path][1]["error"]["code"] == "unavailable"  # type: ignore[index]
                database_proxy.heal()
                broker_proxy.heal()
                await until(lambda: not b.cluster.fenced, timeout_s=15, what="b unfenced")  # type: ignore[union-attr]
                answers = await probe(client)
            assert {path: status for path, (status, _) in answers.items()} == dict.fromkeys(
                PROBES, 200
            )
        finally:
            await device.stop()
    finally:
        broker_proxy.heal()
        await broker_proxy.stop()


async def test_a_draining_instance_is_not_ready_but_alive(cluster: Cluster) -> None:
    a = await cluster.start("a")
    async with cluster.api("a") as api:
        assert (await api.post("/api/cluster/drain")).status_code == 200
    async with httpx.AsyncClient(base_url=a.api_url) as client:
        answers = await probe(client)
    assert answers["/livez"] == (200, {"status": "ok"})
    assert answers["/readyz"][0] == answers["/healthz"][0] == 503
    assert answers["/readyz"][1]["error"]["message"] == "draining"  # type: ignore[index]
