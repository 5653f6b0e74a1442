"""An instance across nodes (server/nodes.py): how its ranks on several hosts form one group.

Node 0 runs the instance's scheduler with rank 0, which listens for the rendezvous on
`dist_init_addr` and spawns node 0's other ranks (`ProcessWorkers`, `remote` = every other
node's ranks). Each other node runs `run_node` (`glm53-serve prefill|decode --node-rank K`, which
`up --node-rank K` starts): it spawns that node's ranks, which dial `dist_init_addr` and join as
followers, and spawns them again whenever they leave the group.

A lost node breaks the group: node 0's next collective fails (at once when the node's processes
die and their sockets close; within the group timeout when the host vanishes), the scheduler
fails what it holds, reports not ready and frees its pages (`Scheduler._break`), and a `Rejoin`
builds a new group in the background — the same store on `dist_init_addr`, a new generation of
it (`NodeRendezvous`), node 0's ranks built again — which the restarted node's ranks join. Every
wait is bounded (1 s slices of the store's wait, the group timeout), repeated until the node is
back or the scheduler stops.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from glm53.models import GlmConfig
from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.engine.group import WorkerGroup
from glm53.server.engine.processes import (GENERATION_FROM_STORE, GENERATION_KEY, Launch, ProcessWorkers,
                                           follower_main, rendezvous_store)
from glm53.server.engine.worker import RankSpec, rank_specs
from glm53.server.model_fit import check_model_fit

log = logging.getLogger(__name__)

# Between two attempts to form the group, and before a node spawns its ranks again: long enough
# not to spin, short against a restart.
RETRY_PAUSE_S = 1.0
# How often node 0 looks for the other nodes' ranks on the rendezvous store.
ARRIVAL_POLL_S = 0.2


def group_timeout(cluster: ClusterConfig) -> float:
    """The instance group's timeout (rendezvous and every collective): long enough for the
    slowest rank to load its weights; a dead rank process is seen at once anyway."""
    return max(120.0, cluster.transfer.transfer_timeout_s)


def remote_ranks(inst: InstanceConfig) -> dict[int, str]:
    """The ranks nodes other than node 0 start, each with a label naming its node."""
    return {r: f"node {k} at {node.host}" for k, node in enumerate(inst.node_list) if k
            for r in inst.node_ranks(k)}


class NodeRendezvous:
    """Node 0's rendezvous of an instance across nodes: one store on `dist_init_addr`, bound
    once for the life of the process (a store's port is not reliably free again while anything
    of a broken group lingers), and one generation of it per group formed: rank 0 publishes the
    generation, the other nodes' ranks read it, mark themselves arrived under it and join
    (processes.generation_store), so a rebuilt group never meets the keys of the one before."""

    def __init__(self, inst: InstanceConfig, timeout_s: float):
        self.inst = inst
        self.host, self.port = inst.rendezvous
        self.remote = remote_ranks(inst)
        self.store = rendezvous_store(self.host, self.port, inst.world_size, timeout_s)
        self.nodes = ", ".join(sorted(set(self.remote.values())))

    def form(self, specs: list[RankSpec], timeout_s: float, deadline: Optional[float],
             stop: Optional[threading.Event] = None) -> ProcessWorkers:
        """The group, once every other node's ranks arrived under a new generation; retried
        (with the next one) when forming fails — a peer that left mid-way. Raises when
        `deadline` (monotonic; None: none) passes or `stop` is set first."""
        while True:
            gen = self.store.add(GENERATION_KEY, 1)
            view = dist.PrefixStore(f"glm53/g{gen}/", self.store)
            self._wait_arrivals(view, gen, deadline, stop)
            try:
                return ProcessWorkers(specs, timeout_s=timeout_s, host=self.host, port=self.port, remote=self.remote,
                                      store=view, generation=gen)
            except Exception as e:  # noqa: BLE001 - retried under the next generation
                if dist.is_initialized():  # it failed after joining: the next attempt joins afresh
                    dist.destroy_process_group()
                if _expired(deadline, stop):
                    raise
                log.warning("%s: group %d did not form (%s); trying again", self.inst.name, gen, e)
                _pause(stop)

    def _wait_arrivals(self, view: dist.Store, gen: int, deadline: Optional[float],
                       stop: Optional[threading.Event]) -> None:
        keys = [f"arrived/{r}" for r in self.remote]
        t0 = last_log = time.monotonic()
        # Polled (`check` does not block), not `wait`ed in slices: every timed-out wait is a
        # warning in torch's own log.
        while not view.check(keys):
            if stop is not None:
                stop.wait(ARRIVAL_POLL_S)
            else:
                time.sleep(ARRIVAL_POLL_S)
            if _expired(deadline, stop):
                raise TimeoutError(f"{self.inst.name}: {self.nodes} did not join at {self.host}:{self.port} within "
                                   f"{time.monotonic() - t0:.0f} s")
            if time.monotonic() - last_log > 30.0:
                last_log = time.monotonic()
                log.warning("%s: waiting for %s to join at %s:%s (group %d, %.0f s)", self.inst.name, self.nodes,
                            self.host, self.port, gen, last_log - t0)


def _expired(deadline: Optional[float], stop: Optional[threading.Event]) -> bool:
    return (deadline is not None and time.monotonic() >= deadline) or (stop is not None and stop.is_set())


def _pause(stop: Optional[threading.Event]) -> None:
    if stop is not None:
        stop.wait(RETRY_PAUSE_S)
    else:
        time.sleep(RETRY_PAUSE_S)


class Rejoin:
    """Rebuild a group that lost a node, in a thread, while the scheduler answers not ready:
    close the broken group, then `build()` (which retries until the node's ranks are back).
    The scheduler takes `result()` once it is there."""

    def __init__(self, old: WorkerGroup, build: Callable[[threading.Event], WorkerGroup], name: str):
        self._old, self._build, self.name = old, build, name
        self._stop = threading.Event()
        self._result: Optional[WorkerGroup] = None
        self._thread = threading.Thread(target=self._run, name=f"rejoin-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._old.close()
        except Exception:  # noqa: BLE001 - a broken group may not close cleanly; a new one is built anyway
            log.exception("%s: closing the broken group", self.name)
        self._old = None
        while not self._stop.is_set():
            try:
                self._result = self._build(self._stop)
                log.info("%s: the lost ranks rejoined; the group is whole again", self.name)
                return
            except Exception as e:  # noqa: BLE001 - retried: the node may come back at any time
                if not self._stop.is_set():
                    log.warning("%s: rebuilding the group failed (%s); retrying", self.name, e)
                    self._stop.wait(RETRY_PAUSE_S)

    def result(self) -> Optional[WorkerGroup]:
        return self._result

    def stop(self, timeout: float) -> Optional[WorkerGroup]:
        """Stop retrying; wait up to `timeout` for an attempt in progress. Returns a group built
        meanwhile (the caller closes it)."""
        self._stop.set()
        self._thread.join(timeout)
        return self._result


def _touch(path: Optional[Path], ready: bool) -> None:
    if path is None:
        return
    if ready:
        path.write_text(str(os.getpid()))
    else:
        path.unlink(missing_ok=True)


def run_node(cluster: ClusterConfig, inst: InstanceConfig, node: int, ready_file: Optional[Path] = None) -> int:
    """`glm53-serve prefill|decode --node-rank K` (K > 0): run node K's ranks of `inst`, spawned
    again each time they leave the group, until SIGTERM/SIGINT. `ready_file` exists while every
    one of them is in the group (`up --node-rank K` waits for it)."""
    from glm53.server.embedded_model import resolve_paths

    logging.basicConfig(level=getattr(logging, cluster.router.log_level.upper(), logging.INFO), stream=sys.stderr,
                        format=f"%(asctime)s {inst.name}-node{node} %(levelname)s %(name)s: %(message)s", force=True)
    ranks = inst.node_ranks(node)
    path, cluster = resolve_paths(cluster)
    check_model_fit(cluster, path)
    specs = rank_specs(cluster, inst, str(path), GlmConfig.from_dir(path).num_hidden_layers)
    host, port = inst.rendezvous
    timeout = group_timeout(cluster)
    backend = "gloo" if specs[0].device == "cpu" else "nccl"
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ctx = mp.get_context("spawn")
    log.info("%s node %d: ranks %s, joining at %s:%s", inst.name, node, list(ranks), host, port)
    while not stop.is_set():
        joined = {r: ctx.Event() for r in ranks}
        procs = [ctx.Process(target=follower_main, daemon=True,
                             name=f"{inst.name}-pp{specs[r].pp_rank}-tp{specs[r].tp_rank}",
                             args=(Launch(specs[r], r, len(specs), host, port, backend, timeout, os.getpid(),
                                          GENERATION_FROM_STORE), joined[r]))
                 for r in ranks]
        for p in procs:
            p.start()
        ready = False
        while not stop.is_set() and all(p.is_alive() for p in procs):
            if not ready and all(e.is_set() for e in joined.values()):
                ready = True
                _touch(ready_file, True)
                log.info("%s node %d: ranks %s joined the group", inst.name, node, list(ranks))
            stop.wait(0.2)
        _touch(ready_file, False)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        if not stop.is_set():
            codes = {p.name: p.exitcode for p in procs}
            log.warning("%s node %d: ranks left the group (exit codes %s); joining again", inst.name, node, codes)
            stop.wait(RETRY_PAUSE_S)
    log.info("%s node %d: stopped", inst.name, node)
    return 0
