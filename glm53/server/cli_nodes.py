"""The command line of instances that span nodes (server/nodes.py): SGLang's `--nnodes`,
`--node-rank`, `--dist-init-addr` on `prefill` / `decode`, `--node-rank` on `up`, and what a
node's `up` runs.

    glm53-serve up --config X --node-rank 0   the router, every instance without `nodes`, and
                                              node 0 of every instance with them (its scheduler)
    glm53-serve up --config X --node-rank K   node K's ranks of every instance with > K nodes
    glm53-serve prefill --config X --instance p0 --node-rank K   one instance's node K

Without --node-rank, `up` starts what the YAML places on this host, as before.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm53.server.config import ClusterConfig, ConfigError, InstanceConfig


def add_up_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-rank", dest="node_rank", type=int,
                   help="run this node's part of the config: 0 = the router, every instance without `nodes` "
                   "and node 0 of those with them; K > 0 = node K's ranks of every instance listing a node K")


def add_instance_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, help="nodes the instance's ranks are split over (the YAML's `nodes`)")
    p.add_argument("--node-rank", dest="node_rank", type=int,
                   help="which node this is (0: the scheduler and rank 0; K > 0: node K's ranks; --host is then "
                   "node K's address)")
    p.add_argument("--dist-init-addr", dest="dist_init_addr", help="HOST:PORT where the instance's ranks meet (node 0)")
    # `up --node-rank K` learns here when node K's ranks are in the group.
    p.add_argument("--ready-file", dest="ready_file", help=argparse.SUPPRESS)


def instance_overrides(args: argparse.Namespace, role: str, index: int) -> dict[str, Any]:
    """The flags as `config_parse.apply_overrides` keys, --nnodes first (it creates the nodes that
    --host may then name). Under --node-rank K > 0, --host is node K's address, not the
    instance's (whose scheduler runs on node 0)."""
    key = f"instance.{role}.{index}"
    o: dict[str, Any] = {}
    if getattr(args, "nnodes", None) is not None:
        o[f"{key}.nnodes"] = args.nnodes
    if getattr(args, "dist_init_addr", None) is not None:
        o[f"{key}.dist_init_addr"] = args.dist_init_addr
    node = getattr(args, "node_rank", None)
    host = getattr(args, "host", None)
    if host is not None:
        if node:
            o[f"{key}.nodes.{node}.host"] = host
        else:
            o[f"{key}.host"] = host
            if node == 0:
                o[f"{key}.nodes.0.host"] = host
    return o


def check_instance_flags(cfg: ClusterConfig, inst: InstanceConfig, args: argparse.Namespace) -> int:
    """--nnodes and --node-rank against the instance's nodes; the node this process runs."""
    n = len(inst.node_list)
    if getattr(args, "nnodes", None) is not None and args.nnodes != n:
        raise ConfigError(cfg.source, "--nnodes", f"{args.nnodes}, but {inst.role} instance {inst.name} lists {n} "
                          "node(s) (`nodes`)")
    node = getattr(args, "node_rank", None) or 0
    if not 0 <= node < n:
        raise ConfigError(cfg.source, "--node-rank", f"must be in 0..{n - 1}: {inst.role} instance {inst.name} has "
                          f"{n} node(s); got {node}")
    return node


@dataclass
class NodePart:
    """Node `node` (> 0) of an instance: the ranks its `up` runs."""

    inst: InstanceConfig
    node: int

    @property
    def name(self) -> str:
        return f"{self.inst.name}@node{self.node}"

    def ready_file(self, run_dir: Path) -> Path:
        return run_dir / f"{self.name}.ready"


@dataclass
class NodeRole:
    """What one `up` runs: whole instances (their schedulers), node parts, and the router."""

    local: list[InstanceConfig]
    parts: list[NodePart] = field(default_factory=list)
    run_router: bool = False


def node_role(cfg: ClusterConfig, node: int) -> NodeRole:
    """`up --node-rank node`: node 0 runs the router and every instance (its node 0 part when it
    lists nodes); node K > 0 runs node K's ranks of the instances listing a node K. The hosts in
    the YAML are not matched against this machine's: the operator says which node this is."""
    if node == 0:
        return NodeRole(list(cfg.instances), [], True)
    if node < 0:
        raise ConfigError(cfg.source, "--node-rank", f"must be >= 0, got {node}")
    parts = [NodePart(i, node) for i in cfg.instances if len(i.node_list) > node]
    if not parts:
        spanning = [f"{i.name} ({len(i.nodes)} nodes)" for i in cfg.instances if i.nodes]
        raise ConfigError(cfg.source, "--node-rank", f"no instance lists a node {node} (instances with `nodes`: "
                          f"{', '.join(spanning) or 'none'})")
    return NodeRole([], parts, False)
