"""Rank processes under `torch.distributed`: the `WorkerGroup` of an instance with tp > 1.

Rank 0 lives in the scheduler's process; ranks 1..N-1 are processes it spawns. All join one
process group (gloo on CPU; NCCL for the model's collectives on CUDA plus a gloo group for the
commands). Every scheduler step is one `Command` from rank 0: the transfer operations queued
since the last one (open a room's sender/receiver, send pages, finish, abort), then optionally a
forward over the step's chunks. It travels through the step channel (step_channel.py: shared
memory between ranks of one node, and of the batch only what changed since the last step,
step_delta.py). Every rank runs it on its own `RankWorker` — the forward's collectives pair up
because every rank runs the same batch — and rank 0 collects each rank's transfer states. A
follower's handles are represented on rank 0 by `RemoteHandle`s that queue operations and report
the states last collected, so a room is still one `RoomTransfer` whose pages are freed only when
every rank is terminal.

A rank that dies breaks the group: the next collective raises (or the step channel sees the
process gone), the group reports `RanksLost` and the scheduler fails what it holds (it never
waits longer than the group timeout).
"""

from __future__ import annotations

import datetime
import gc
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from glm53.models import SeqChunk
from glm53.models.draft import DraftBlock
from glm53.models.readback import readback
from glm53.models.spec_state import SpecOutput
from glm53.server import heap
from glm53.server.engine.group import WorkerGroup
from glm53.server.engine.pipeline import StagePipe, StageStats
from glm53.server.engine.step_channel import open_follower, open_leader
from glm53.server.engine.worker import RankSpec, RankWorker
from glm53.transport import KVPoll, MetadataRow, Room, RoomTransfer, TransferError, TransferErrorCode

log = logging.getLogger(__name__)

RoomKey = tuple[int, int]


class RanksLost(RuntimeError):
    """A rank of the instance died or stopped answering; the group cannot run any more."""


@dataclass(frozen=True)
class Op:
    """One transfer operation, replayed in order on one follower (`rank`) or on all (None)."""

    name: str  # "open_sender" | "open_receiver" | "send_pages" | "finish" | "abort"
    room: RoomKey
    args: tuple = ()
    rank: Optional[int] = None


@dataclass
class Command:
    ops: list[Op] = field(default_factory=list)
    microbatches: Optional[list[list[SeqChunk]]] = None  # a forward after the ops (pipelined over stages)
    spec: Optional[list[DraftBlock]] = None  # or a speculative step (propose + verify; one stage)
    stop: bool = False
    copies: list[tuple[list[int], list[int]]] = field(default_factory=list)  # KV page copies, before the forward


@dataclass(frozen=True)
class HandleState:
    """A follower handle's state as rank 0 last saw it."""

    state: KVPoll
    error: str = ""
    error_code: Optional[TransferErrorCode] = None
    row: Optional[MetadataRow] = None  # receivers, at SUCCESS
    stats: Optional[dict] = None  # senders, once terminal: transfers, descriptors, bytes posted


@dataclass(frozen=True)
class Launch:
    """What a follower process needs to join the group."""

    spec: RankSpec
    rank: int
    world_size: int
    store_host: str  # rank 0's rendezvous store, already listening (`rendezvous_store`)
    store_port: int
    backend: str
    timeout_s: float
    parent_pid: int
    # An instance across nodes forms each group under its own generation of one long-lived store
    # (`generation_store`); GENERATION_FROM_STORE: the current one, as rank 0 published it.
    # None: a group of one host, alone on its store.
    generation: Optional[int] = None


GENERATION_KEY = "glm53/generation"
GENERATION_FROM_STORE = -1


class RankRuntime:
    """What every rank runs per command: its ops on its own handles, then its stage's forward."""

    def __init__(self, worker: RankWorker, rank: int, pipe: Optional[StagePipe] = None):
        self.worker, self.rank, self.pipe = worker, rank, pipe
        self.handles: dict[RoomKey, Any] = {}

    @property
    def stage_stats(self) -> Optional[StageStats]:
        return self.pipe.stats if self.pipe is not None else None

    def apply(self, cmd: Command) -> tuple[Any, dict[RoomKey, HandleState]]:
        """The forward's logits, the speculative step's `SpecOutput`, or None; and the
        transfer states of this rank's handles."""
        for op in cmd.ops:
            if op.rank in (None, self.rank):
                self._apply(op)
        for src, dst in cmd.copies:
            self.worker.copy_pages(src, dst)
        out = None
        if cmd.microbatches:
            out = self.worker.forward_microbatches(cmd.microbatches, self.pipe)
        elif cmd.spec:
            out = self.worker.spec_step(cmd.spec)
        return out, self.report()

    def _apply(self, op: Op) -> None:
        room = Room(*op.room)
        try:
            if op.name == "open_sender":
                self.handles[op.room] = self.worker.create_sender(room, *op.args)
            elif op.name == "open_receiver":
                self.handles[op.room] = self.worker.create_receiver(room, *op.args)
            elif op.room in self.handles:
                getattr(self.handles[op.room], op.name)(*op.args)
        except TransferError as e:  # this room only: reported failed, never the group
            self.handles[op.room] = _Failed(str(e), e.code)

    def report(self) -> dict[RoomKey, HandleState]:
        out = {}
        for key, h in list(self.handles.items()):
            state = h.poll()
            row = h.metadata() if state == KVPoll.SUCCESS and h.kind == "receiver" else None
            terminal = state in (KVPoll.SUCCESS, KVPoll.FAILED)
            stats = h.stats if terminal and h.kind == "sender" else None
            out[key] = HandleState(state, h.error, h.error_code, row, stats)
            if terminal:
                del self.handles[key]  # terminal is final: reported once, then forgotten
        return out


class _Failed:
    """A handle that could not be created on this rank."""

    kind = ""

    def __init__(self, error: str, code: TransferErrorCode):
        self.error, self.error_code = error, code

    def poll(self) -> KVPoll:
        return KVPoll.FAILED


class RemoteHandle:
    """Rank 0's stand-in for a follower's sender or receiver of one room."""

    def __init__(self, group: "ProcessWorkers", kind: str, room: Room, rank: int, last_stage: bool):
        self.kind, self.room, self.rank, self.last_stage = kind, room, rank, last_stage
        self._group = group
        self._seen = HandleState(KVPoll.BOOTSTRAPPING)

    def update(self, st: HandleState) -> None:
        if self._seen.state not in (KVPoll.SUCCESS, KVPoll.FAILED):
            self._seen = st

    def poll(self) -> KVPoll:
        return self._seen.state

    @property
    def error(self) -> str:
        return self._seen.error

    @property
    def error_code(self) -> Optional[TransferErrorCode]:
        return self._seen.error_code

    @property
    def stats(self) -> dict:
        """A sender's transfers, descriptors and bytes, as the rank reported them when terminal."""
        return dict(self._seen.stats or {})

    def metadata(self) -> MetadataRow:
        if self._seen.row is None:
            raise TransferError(f"room {self.room}: no metadata from rank {self.rank}", TransferErrorCode.INVALID)
        return self._seen.row

    def abort(self, reason: str = "") -> None:
        self._group.queue(Op("abort", self.room.key, (reason,), self.rank))

    def send_pages(self, src_pages, start: Optional[int] = None) -> None:
        self._group.queue(Op("send_pages", self.room.key, (list(src_pages), start), self.rank))

    def finish(self, row: Optional[MetadataRow] = None) -> None:
        self._group.queue(Op("finish", self.room.key, (row,), self.rank))


def rendezvous_store(host: str, port: int | None, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening before any follower starts: on the pinned port, or
    on one the store binds itself (port 0) and keeps, so no probed port is released for someone
    else (a UCX listener, another server) to take before the group forms."""
    return dist.TCPStore(host, port or 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def generation_store(store: dist.Store, generation: int, rank: int) -> dist.Store:
    """This rank's view of one group generation of a long-lived rendezvous store (an instance
    across nodes: node 0's store is bound once, and a group rebuilt after a lost node must not
    meet the keys of the one before). Marks the rank arrived there, which rank 0 waits for."""
    if generation == GENERATION_FROM_STORE:
        generation = int(store.get(GENERATION_KEY))  # waits, bounded by the store's timeout
    view = dist.PrefixStore(f"glm53/g{generation}/", store)
    view.set(f"arrived/{rank}", "1")
    return view


def _join(launch: Launch, store: Optional[dist.Store] = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup,
                                                                        Optional[tuple]]:
    """Join the instance's process group. Returns this rank's stage TP group, the gloo group
    commands travel on (the world group itself on CPU) and its neighbours' ranks (previous,
    next stage; None with one stage). Ranks are pp-major: stage s holds ranks s*tp .. s*tp+tp-1."""
    spec = launch.spec
    timeout = datetime.timedelta(seconds=launch.timeout_s)
    if launch.backend == "nccl":
        torch.cuda.set_device(torch.device(spec.device))
    if store is None:  # a follower: a client of rank 0's store
        store = dist.TCPStore(launch.store_host, launch.store_port, launch.world_size, is_master=False,
                              timeout=timeout)
        if launch.generation is not None:
            store = generation_store(store, launch.generation, launch.rank)
    dist.init_process_group(launch.backend, store=store, rank=launch.rank, world_size=launch.world_size,
                            timeout=timeout)
    world = dist.group.WORLD
    control = world if launch.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    tp, pp = spec.tp_size, spec.pp_size
    if pp == 1:
        return world, control, None
    # Every rank creates every stage's group, in the same order (torch.distributed requires it).
    stage_groups = [dist.new_group(ranks=list(range(s * tp, (s + 1) * tp)), timeout=timeout) for s in range(pp)]
    r = launch.rank
    return stage_groups[spec.pp_rank], control, (r - tp if spec.pp_rank > 0 else None,
                                                 r + tp if not spec.last_stage else None)


def _pipe(links: Optional[tuple], worker: RankWorker) -> Optional[StagePipe]:
    return StagePipe(*links, dtype=worker.dtype, device=worker.device) if links else None


def _agree_pages(worker: RankWorker, control: dist.ProcessGroup) -> int:
    """One page-id space: every rank allocates the smallest capacity of any rank."""
    cap = torch.tensor([worker.capacity()], dtype=torch.long)
    dist.all_reduce(cap, op=dist.ReduceOp.MIN, group=control)
    return int(cap.item())


def follower_main(launch: Launch, joined: Any = None) -> None:
    """Entry of rank 1..N-1: join, load, allocate, then run commands until told to stop or the
    group breaks. `joined` (a multiprocessing Event, for ranks another node starts): set once
    this rank is in the group with its pools allocated (engine/node_ranks.py reports the node
    ready then)."""
    spec = launch.spec
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {spec.instance}-pp{spec.pp_rank}-tp{spec.tp_rank} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scheduler decides when ranks stop
    torch.set_grad_enabled(False)
    if spec.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    _watch_parent(launch.parent_pid)
    tp, control, links = _join(launch)
    worker = RankWorker(spec, tp_group=tp)
    worker.allocate(_agree_pages(worker, control))
    dist.barrier(group=control)
    if joined is not None:
        joined.set()
    runtime = RankRuntime(worker, launch.rank, _pipe(links, worker))
    # The first rank of the last stage returns the step's results (rank 0 has them itself at pp 1).
    answers = spec.last_stage and spec.tp_rank == 0
    channel = None
    heap.settle()
    try:
        channel = open_follower(control, launch.rank, launch.world_size, launch.timeout_s,
                                alive=lambda: os.getppid() == launch.parent_pid)
        while True:
            (ops, copies, stop), microbatches, blocks = channel.recv()
            if stop:
                break
            out, report = runtime.apply(Command(ops, microbatches, blocks, copies=copies))
            channel.answer((report, _to_cpu(out) if answers else None, runtime.stage_stats))
    except Exception as e:  # the group broke (rank 0 gone): nothing left to serve
        log.warning("rank %d leaves: %s", launch.rank, e)
    finally:
        if channel is not None:
            channel.close()
        worker.close()


def _to_cpu(out: Any) -> Any:
    """Step results for pickling (logits may live on a GPU)."""
    if isinstance(out, torch.Tensor):
        return readback(out)
    if isinstance(out, (list, tuple)):
        res = type(out)(_to_cpu(x) for x in out)
        if getattr(out, "last_hidden", None) is not None:  # runner.ChunkLogits: the MTP's seed rows
            res.last_hidden = readback(out.last_hidden)
        return res
    return out


def _watch_parent(pid: int) -> None:
    """A follower outlives a killed scheduler only until the next collective times out; this
    ends it within a second instead."""
    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ProcessWorkers(WorkerGroup):
    """An instance's ranks as processes: rank 0 here, the followers spawned and joined."""

    def __init__(self, specs: Sequence[RankSpec], timeout_s: float = 60.0, host: str = "127.0.0.1",
                 port: int | None = None, remote: Optional[dict[int, str]] = None,
                 store: Optional[dist.Store] = None, generation: Optional[int] = None):
        """`host`, `port`: where rank 0's rendezvous store listens (port None: one it binds).
        `remote`: ranks that other nodes start and that join through that store (an instance
        across nodes, engine/node_ranks.py), each with a label naming its node for errors; the
        rest are spawned here. `store`, `generation`: a group of an instance across nodes, on
        this generation's view of node 0's long-lived store (engine/node_ranks.NodeRendezvous)
        listening on `host`:`port`; without them the group gets a store of its own."""
        self.specs = list(specs)
        world = len(specs)
        self.remote = dict(remote or {})
        self.pp = specs[0].pp_size
        # The first rank of the last stage answers a step (logits, proposals).
        self._answer_rank = next(r for r, sp in enumerate(specs) if sp.last_stage and sp.tp_rank == 0)
        backend = "gloo" if specs[0].device == "cpu" else "nccl"
        if store is None:
            store = rendezvous_store(host, port, world, timeout_s)
            port = store.port
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, daemon=True,
                                  name=f"{specs[r].instance}-pp{specs[r].pp_rank}-tp{specs[r].tp_rank}",
                                  args=(Launch(specs[r], r, world, host, port, backend, timeout_s,
                                               os.getpid(), generation),))
                      for r in range(1, world) if r not in self.remote]
        for p in self.procs:
            p.start()
        self._closed = False
        self._lost = ""
        self._queue: list[Op] = []
        self._copies: list[tuple[list[int], list[int]]] = []
        self._remote: dict[RoomKey, list[RemoteHandle]] = {}
        self.stage_stats: list[Optional[StageStats]] = []  # per rank, as of the last step
        try:
            tp, self._control, links = _join(Launch(specs[0], 0, world, host, port, backend, timeout_s,
                                                    os.getpid()), store)
            self.rank = RankWorker(specs[0], tp_group=tp)
            self.num_pages = _agree_pages(self.rank, self._control)
            self.rank.allocate(self.num_pages)
            dist.barrier(group=self._control)
            # The per-step control round (engine/step_channel.py): shared memory when every rank
            # is a process of this node, else the control group's collectives.
            self.channel = open_leader(self._control, world, "gloo" if self.remote else "shm", timeout_s,
                                       alive=lambda: all(p.is_alive() for p in self.procs))
        except Exception:
            self._kill()
            raise
        self.runtime = RankRuntime(self.rank, 0, _pipe(links, self.rank))
        self.cfg = self.rank.cfg
        self.page_size = specs[0].page_size
        self.bytes_per_page = self.rank.bytes_per_page  # rank 0's pools (its stage, its heads)
        self.draft_bytes_per_page = self.rank.draft_bytes_per_page
        self.block_size = self.rank.block_size  # decode: one stage, so rank 0 holds the draft
        last = specs[self._answer_rank]
        self.sends_draft_kv = bool(last.draft_path or last.nextn_steps) and last.send_draft_kv

    def queue(self, op: Op) -> None:
        self._queue.append(op)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self._copies.append((list(src), list(dst)))  # with the next command, before its forward

    def _run(self, microbatches: Optional[list[list[SeqChunk]]] = None,
             spec: Optional[list[DraftBlock]] = None) -> Any:
        if self._lost:
            raise RanksLost(self._lost)
        cmd, self._queue = Command(self._queue, microbatches, spec, copies=self._copies), []
        self._copies = []
        try:
            # Only what changed of the batch travels (engine/step_delta.py); every rank answers.
            self.channel.send((cmd.ops, cmd.copies, False), cmd.microbatches, cmd.spec)
            out, mine = self.runtime.apply(cmd)
            replies = self.channel.collect()
            replies[0] = (mine, None, self.runtime.stage_stats)
        except RuntimeError as e:
            self._lost = f"{self._who_is_lost()} lost: {e}"
            raise RanksLost(self._lost) from None
        if self._answer_rank:
            out = replies[self._answer_rank][1]
        self.stage_stats = [st for _, _, st in replies]
        for rank, (report, _, _) in enumerate(replies[1:], 1):
            for key, st in report.items():
                for h in self._remote.get(key, ()):
                    if h.rank == rank:
                        h.update(st)
        for key in [k for k, hs in self._remote.items() if all(h.poll() in (KVPoll.SUCCESS, KVPoll.FAILED)
                                                               for h in hs)]:
            del self._remote[key]
        return out

    def forward_microbatches(self, microbatches: list[list[SeqChunk]]) -> list[list[torch.Tensor]]:
        return self._run(microbatches)

    def spec_step(self, blocks: list[DraftBlock]) -> SpecOutput:
        return self._run(spec=blocks)

    def sync(self) -> None:
        self._run()

    def _open(self, kind: str, room: Room, local, args: tuple) -> RoomTransfer:
        self.queue(Op("open_" + kind, room.key, args))
        remote = [RemoteHandle(self, kind, room, r, self.specs[r].last_stage) for r in range(1, len(self.specs))]
        self._remote[room.key] = remote
        return RoomTransfer([local, *remote])

    def create_senders(self, room: Room, decode_instance: str) -> RoomTransfer:
        return self._open("sender", room, self.rank.create_sender(room, decode_instance), (decode_instance,))

    def create_receivers(self, room: Room, bootstrap_address: str, dst_pages: list[int]) -> RoomTransfer:
        local = self.rank.create_receiver(room, bootstrap_address, dst_pages)
        return self._open("receiver", room, local, (bootstrap_address, list(dst_pages)))

    @property
    def lost(self) -> str:
        return self._lost

    @property
    def spans_nodes(self) -> bool:
        """Some ranks run on other nodes: when the group breaks, their node's ranks can join a
        new one (the scheduler rebuilds the group, engine/node_ranks.Rejoin)."""
        return bool(self.remote)

    def _who_is_lost(self) -> str:
        """The rank processes that died here, else (nothing died here) the other nodes' ranks:
        a collective that fails with every local rank alive lost a peer on another node."""
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            return f"rank process {', '.join(dead)}"
        if self.remote:
            return "a rank on another node (" + ", ".join(sorted(set(self.remote.values()))) + ")"
        return "rank process ?"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._lost:
            try:
                self.channel.send(([], [], True))
            except RuntimeError:
                pass
        self.channel.close()
        if not self._lost:  # a broken group's ranks here would only wait out its timeout: killed at once
            for p in self.procs:
                p.join(timeout=10)
        self._kill()
        self.rank.close()
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group may refuse a clean teardown; the process is ending
            pass
        # Nothing of the group outlives it: rank 0's model and pools are freed before a group
        # rebuilt in this process (engine/node_ranks.Rejoin) loads and allocates its own.
        self.rank = self.runtime = self._control = self.channel = None
        self._remote.clear()
        heap.thaw()  # cycles of the group frozen at start-up are collectable again
        gc.collect()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
