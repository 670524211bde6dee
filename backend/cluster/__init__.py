"""Several bridge instances serving one fleet: device leases in the shared database, fleet events
and forwarded calls over the deployment's MQTT broker (docs/cluster.md)."""

from backend.cluster.leases import CLUSTER_MIGRATIONS, LeaseTable
from backend.cluster.node import ClusterNode, ClusterOptions

__all__ = ["CLUSTER_MIGRATIONS", "ClusterNode", "ClusterOptions", "LeaseTable"]
