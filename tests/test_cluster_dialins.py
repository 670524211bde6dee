"""MCP servers dialed in to one cluster instance are listed by every instance (docs/cluster.md):
each instance publishes its dial-ins as a retained message on the cluster broker, shown by the
others while its presence is up; a malformed entry from a peer is skipped, not a 500."""

from backend.cluster import wire
from backend.mcp_dialin.endpoint import server_name
from testkit.cluster import Cluster, until
from tests.cluster_helpers import cluster
from tests.dialin_helpers import RawPipe
from tests.helpers import create_key

# Fixtures shared by the cluster tests (tests/cluster_helpers.py).
__all__ = ["cluster"]


async def servers_on(cluster: Cluster, name: str) -> list[dict[str, object]]:
    async with cluster.api(name) as api:
        reply = await api.get("/api/mcp/servers")
    assert reply.status_code == 200, reply.text
    servers: list[dict[str, object]] = reply.json()["servers"]
    return servers


async def test_a_server_dialed_in_to_a_is_listed_by_b_until_it_leaves(cluster: Cluster) -> None:
    a = await cluster.start("a")
    b = await cluster.start("b")
    token = await create_key(a, "mcp:endpoint", devices=["aa:bb:cc:dd:ee:01"])
    name = server_name(token.split("_")[1])
    pipe = await RawPipe(f"ws://127.0.0.1:{a.http_port}/v1/mcp-endpoint/?token={token}").start()
    await until(lambda: b.cluster.remote_dialins(), what="b hears of the dial-in")  # type: ignore[union-attr]
    on_a = {row["name"]: row for row in await servers_on(cluster, "a")}
    on_b = {row["name"]: row for row in await servers_on(cluster, "b")}
    assert on_a[name]["instance"] == "a" and on_b[name]["instance"] == "a"
    assert on_b[name]["kind"] == "dialin" and on_b[name]["state"] == "ready"
    assert on_b[name]["tools"] == on_a[name]["tools"]

    # A peer's malformed entry is skipped; the good ones stay listed.
    topic = b.cluster.topics.dialins("a")  # type: ignore[union-attr]
    bad = {"servers": [{"name": "x", "kind": "nonsense"}, on_a[name]]}
    assert a.cluster is not None
    await a.cluster.fabric.publish(topic, wire.dumps(bad), retain=True)
    await until(lambda: len(b.cluster._remote_dialins.get("a", [])) == 2)  # type: ignore[union-attr]
    assert [row["name"] for row in await servers_on(cluster, "b")] == [name]

    await pipe.close()
    await until(lambda: not b.cluster.remote_dialins(), what="b hears it left")  # type: ignore[union-attr]
    assert name not in [row["name"] for row in await servers_on(cluster, "b")]

    # An instance that stops takes its dial-ins out of the others' listings.
    pipe = await RawPipe(f"ws://127.0.0.1:{a.http_port}/v1/mcp-endpoint/?token={token}").start()
    await until(lambda: b.cluster.remote_dialins(), what="b hears of it again")  # type: ignore[union-attr]
    await cluster.stop("a")
    await until(lambda: not b.cluster.remote_dialins(), what="gone with a")  # type: ignore[union-attr]
    await pipe.close()
