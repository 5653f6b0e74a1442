"""Instances that span nodes: which node runs which rank, and the rendezvous address.

An instance's `pp × tp` ranks are numbered pp-major (stage s holds ranks s·tp .. s·tp + tp − 1,
engine/worker.rank_specs). A `nodes:` list of n entries splits them evenly and in that order:
node k runs ranks k·w/n .. (k+1)·w/n − 1 (w = pp·tp), so the split is stage-major — pp = 2 on two
nodes puts one whole stage on each, and a TP group is cut across nodes only when a stage has more
ranks than a node. Node 0 runs rank 0, hence the instance's scheduler and its control endpoints.
Pure functions of plain numbers and strings: the config checks, `rank_specs`, the rank spawner
and `up` all ask here, so they cannot disagree.
"""

from __future__ import annotations


def ranks_per_node(world: int, n_nodes: int) -> int:
    """Ranks on each node; ValueError when the nodes do not divide the ranks evenly."""
    if n_nodes < 1:
        raise ValueError(f"at least one node is needed, got {n_nodes}")
    if world % n_nodes:
        raise ValueError(f"{n_nodes} nodes do not divide pp × tp = {world} ranks evenly")
    return world // n_nodes


def node_ranks(world: int, n_nodes: int, node: int) -> range:
    """The global ranks node `node` runs."""
    per = ranks_per_node(world, n_nodes)
    if not 0 <= node < n_nodes:
        raise ValueError(f"node rank {node} is out of range for {n_nodes} nodes")
    return range(node * per, (node + 1) * per)


def node_of_rank(world: int, n_nodes: int, rank: int) -> int:
    """The node that runs global rank `rank`."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is out of range for {world} ranks")
    return rank // ranks_per_node(world, n_nodes)


def parse_host_port(addr: str) -> tuple[str, int]:
    """`HOST:PORT` (`[v6]:PORT` for IPv6) as SGLang's --dist-init-addr writes it; ValueError
    saying what is wrong otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port must be in 1..65535, got {addr!r}")
    return host, int(port)
