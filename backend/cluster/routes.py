"""The cluster's routes (docs/cluster.md): `GET /api/cluster` (instances, their devices, leases,
heartbeat lag; scope devices:read) and `POST /api/cluster/drain` (admin: this instance takes no
new devices and tells its devices to reconnect elsewhere)."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends

from backend.api.errors import errors
from backend.api.scopes import needs
from backend.cluster.node import ClusterNode
from backend.keys import Principal, Scope

Reader = Annotated[Principal, Depends(needs(Scope.DEVICES_READ))]
Admin = Annotated[Principal, Depends(needs(Scope.ADMIN))]


def cluster_router(node: ClusterNode) -> APIRouter:
    """The routes of one instance's cluster node."""
    router = APIRouter(tags=["cluster"])

    @router.get("/api/cluster", responses=errors(401, 403, 503))
    async def cluster_status(_reader: Reader) -> dict[str, Any]:
        """Every instance (alive, draining, heartbeat lag, devices, MQTT shards), the leases."""
        return await node.status()

    @router.post("/api/cluster/drain", responses=errors(401, 403, 503))
    async def drain(_admin: Admin) -> dict[str, Any]:
        """Drain this instance: no new devices; the connected ones are told to reconnect."""
        told = await node.drain()
        return {"instance": node.instance_id, "draining": True, "devices_told": told}

    return router
