"""The cluster's routes (docs/cluster.md): `GET /api/cluster` (instances, their devices, leases,
heartbeat lag; scope devices:read; `enabled: false` on a single bridge) and
`POST /api/cluster/drain` (admin: this instance takes no new devices and tells its devices to
reconnect elsewhere; 409 on a single bridge)."""

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
    async def drain(_admin: Admin) -> dict[str, Any]:
        """Drain this instance: no new devices; the connected ones are told to reconnect."""
        if node is None:
            raise ApiError(409, "not_clustered", "this bridge is not in a cluster (no cluster_url)")
        told = await node.drain()
        return {"instance": node.instance_id, "draining": True, "devices_told": told}

    return router
