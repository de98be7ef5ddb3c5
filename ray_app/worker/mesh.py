"""The mesh FSDP shards over (``train.replicate``): plain FSDP over every rank, or HSDP, replica groups that
each hold the whole model sharded over their own ranks.

Under HSDP, FSDP2 is given a 2-D mesh (``replicate`` x ``shard``): a unit's all-gathers and its gradients'
reduce-scatter stay inside a shard group, and one all-reduce of each rank's reduced gradient shard goes
across the replica groups. With a node's ranks as one shard group (``train.replicate: auto``), the frequent
collectives use the node's own links (NVLink) and only that all-reduce crosses the network.

Which ranks share a node comes from the ranks themselves: every rank tells its node (one
``all_gather_object``: Ray's node id, or ``$RAY_APP_NODE_ID`` where set, which lets a test on one machine
put ranks on pretend nodes), and the ranks are grouped by node, whatever order Ray gave the ranks. The mesh
is then ``DeviceMesh(device_type, groups)`` with ``groups[r][s]`` the global rank of shard ``s`` of replica
group ``r`` (``init_device_mesh`` assumes a node's ranks are consecutive).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ray_app.shared.errors import ConfigError

NODE_ENV = "RAY_APP_NODE_ID"  # this rank's node, instead of Ray's node id
DIMS = ("replicate", "shard")

BY_NODE, WITHIN_NODES, SPANNING_NODES = "by node", "within nodes", "spanning nodes"


@dataclass(frozen=True)
class MeshPlan:
    """Which ranks shard together: ``groups[r][s]`` is the global rank of shard ``s`` of replica group ``r``;
    ``grouping`` says how the groups lie on the nodes (``BY_NODE``: a group is a node's ranks;
    ``WITHIN_NODES``: each group inside one node; ``SPANNING_NODES``; empty: one group, nodes not asked)."""

    groups: tuple[tuple[int, ...], ...]
    grouping: str = ""

    @property
    def replicate(self) -> int:
        return len(self.groups)

    @property
    def shard(self) -> int:
        return len(self.groups[0])

    def replica_of(self) -> list[int]:
        """Each rank's replica group, in rank order."""
        out = [0] * (self.replicate * self.shard)
        for r, group in enumerate(self.groups):
            for rank in group:
                out[rank] = r
        return out

    def describe(self) -> str:
        """What the start line says: ``mesh shard 4``, ``mesh replicate 2 x shard 2 (shard groups by node)``."""
        if self.replicate == 1:
            return f"mesh shard {self.shard}"
        return f"mesh replicate {self.replicate} x shard {self.shard} (shard groups {self.grouping})"


def single_group(world_size: int) -> MeshPlan:
    """Plain FSDP: every rank a shard of one group."""
    return MeshPlan((tuple(range(world_size)),))


def plan_mesh(replicate: str, nodes: list[str], names: dict[str, str] | None = None) -> MeshPlan:
    """The groups for ``train.replicate`` (``auto`` or a whole number as a string) given each rank's node, in
    rank order (``names``: what a line calls a node, its host's name; else its id). ``auto``: one replica group
    per node, each node's ranks a shard group; a ConfigError when the nodes hold unequal numbers of ranks. N:
    groups of world/N ranks, taken node by node (each node's ranks in rank order), so a group lies inside a
    node wherever the sizes allow."""
    world = len(nodes)
    by_node = _ranks_by_node(nodes)
    if replicate == "auto":
        counts = {len(ranks) for ranks in by_node.values()}
        if len(counts) > 1:
            found = ", ".join(f"{(names or {}).get(node, node)} {len(ranks)}" for node, ranks in by_node.items())
            raise ConfigError(f"train.replicate=auto: the {world} workers are on {len(by_node)} nodes with unequal "
                              f"numbers of ranks (node and ranks: {found}) and HSDP needs the same number on each: "
                              "give every node as many workers as it has GPUs (scaling.num_workers = nodes x GPUs per "
                              "node), or set train.replicate to a number that divides scaling.num_workers")
        if len(by_node) == 1:
            return single_group(world)
        return MeshPlan(tuple(tuple(ranks) for ranks in by_node.values()), BY_NODE)
    n = int(replicate)
    if world % n:
        raise ConfigError(f"train.replicate={n} does not divide the world size {world}: HSDP needs replica groups "
                          "of equal size; use a divisor of scaling.num_workers, or auto (one group per node)")
    if n == 1:
        return single_group(world)
    size = world // n
    order = [rank for ranks in by_node.values() for rank in ranks]
    groups = tuple(tuple(order[i:i + size]) for i in range(0, world, size))
    return MeshPlan(groups, _grouping(groups, nodes, len(by_node)))


def _ranks_by_node(nodes: list[str]) -> dict[str, list[int]]:
    """Each node's ranks in rank order; the nodes in the order of their first rank (rank 0's node first)."""
    out: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        out.setdefault(node, []).append(rank)
    return out


def _grouping(groups, nodes: list[str], node_count: int) -> str:
    if all(len({nodes[r] for r in g}) == 1 for g in groups):
        return BY_NODE if len(groups) == node_count else WITHIN_NODES
    return SPANNING_NODES


def this_node(ray_node: str | None = None) -> tuple[str, str]:
    """This rank's node and what a line calls it: ``$RAY_APP_NODE_ID`` where set, else Ray's node id (called by
    the host's name: a pod's on Kubernetes), else the host name."""
    host = socket.gethostname()
    named = os.environ.get(NODE_ENV)
    return (named, named) if named else (ray_node or host, host)


def gather_nodes(node: tuple[str, str], world_size: int) -> list[tuple[str, str]]:
    """Every rank's (node, name), in rank order (one ``all_gather_object``: every rank calls it)."""
    import torch.distributed as dist

    from ray_app.worker.collectives import entered

    if world_size <= 1 or not dist.is_initialized():
        return [node]
    nodes: list = [None] * world_size
    with entered("nodes (all_gather_object)"):
        dist.all_gather_object(nodes, node)  # sync point: all ranks, once per worker-group start
    return [(str(n), str(name)) for n, name in nodes]


def mesh_plan(replicate: str, world_size: int, ray_node: str | None = None) -> MeshPlan:
    """The plan for this run (every rank calls it at the same point): replicate 1 asks no node."""
    if replicate == "1":
        return single_group(world_size)
    nodes = gather_nodes(this_node(ray_node), world_size)
    return plan_mesh(replicate, [n for n, _ in nodes], dict(nodes))


def device_mesh(plan: MeshPlan, device_type: str):
    """The ``DeviceMesh`` FSDP2 is given: 1-D (``shard``) for one group, else 2-D (``replicate``, ``shard``)
    with the plan's groups as rows (every rank builds it with the same plan: its sub-groups are collectives)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if plan.replicate == 1:
        return init_device_mesh(device_type, (plan.shard,), mesh_dim_names=DIMS[1:])
    return DeviceMesh(device_type, torch.tensor(plan.groups, dtype=torch.int), mesh_dim_names=DIMS)
