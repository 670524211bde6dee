"""The cluster's routes (docs/cluster.md): `GET /api/cluster` (instances, their devices, leases,
heartbeat lag; scope devices:read; `enabled: false` on a single bridge) and
`POST /api/cluster/drain` (admin: this instance takes no new devices and, after the balancer
noticed, moves its devices elsewhere at a bounded rate; 409 on a single bridge)."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from backend.api.app import ApiError
from backend.api.errors import errors
from backend.api.scopes import needs
from backend.cluster.node import ClusterNode
from backend.keys import Principal, Scope

Reader = Annotated[Principal, Depends(needs(Scope.DEVICES_READ))]
Admin = Annotated[Principal, Depends(needs(Scope.ADMIN))]


def cluster_router(node: ClusterNode | None) -> APIRouter:
    """The routes of this instance's cluster node (None: a single bridge)."""
    router = APIRouter(tags=["cluster"])

    @router.get("/api/cluster", responses=errors(503))
    async def cluster_status(_reader: Reader) -> dict[str, Any]:
        """Every instance (alive, draining, heartbeat lag, devices, MQTT shards), the leases."""
        if node is None:
            return {"enabled": False, "instance": None, "instances": []}
        return {"enabled": True, **await node.status()}

    @router.post("/api/cluster/drain", responses=errors(409, 503))
    async def drain(_admin: Admin, wait: bool = False) -> dict[str, Any]:
        """Drain this instance: readiness 503 and no new devices at once; after
        `drain_notice_s` its devices are told to reconnect at `drain_rate_per_s`, each once its
        calls finished. Answers at once with the progress (`GET /api/cluster` shows it as
        `drain`), or when done with `wait=true`. A second call joins the first."""
        if node is None:
            raise ApiError(409, "not_clustered", "this bridge is not in a cluster (no cluster_url)")
        progress = node.start_drain()
        if wait:
            await node.drain()
        return {
            "instance": node.instance_id,
            "draining": True,
            "devices_told": progress.devices_told,
            **progress.as_dict(),
        }

    return router
