"""What callers hold: the room identity, states, error codes, configuration, and the per-room
handles ``KVSender`` (prefill) and ``KVReceiver`` (decode).

Handles never block and never touch NIXL or ZMQ: they record intent on the room's state under
the engine lock and wake the engine's progress thread, which does the work.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Optional, Union

import numpy as np

from .buffers import MetadataRow

if TYPE_CHECKING:
    from .engine import TransferEngine
    from .receiver import ReceiverRoom
    from .sender import SenderRoom


class KVPoll(enum.IntEnum):
    """Transfer state (docs/ARCHITECTURE.md, "Transfer lifecycle"). ``FAILED`` and ``SUCCESS``
    are terminal, and are only reported once the pages involved are safe to free (no write of
    this room can still land). The order of the other members is their order of progress."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


TERMINAL = (KVPoll.FAILED, KVPoll.SUCCESS)


class TransferErrorCode(str, enum.Enum):
    """Why a room failed. Set where the failure is raised and carried over the wire (FAIL,
    ABORT and HELLO_ACK messages), so a room failed by its peer reports the peer's cause."""

    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"  # peer instance or destination info not in time
    # The room waited out the queue bound (queue_timeout_s): prefill did not admit it, or decode
    # did not send its destination. Queueing, not a transfer fault.
    QUEUE_TIMEOUT = "queue_timeout"
    TRANSFER_TIMEOUT = "transfer_timeout"  # the commit did not arrive in time
    PEER_DEAD = "peer_dead"  # a peer sent nothing, not even a heartbeat, for peer_timeout_s
    ABORTED = "aborted"  # abort() on either side
    CLOSED = "closed"  # the engine closed while the room was live
    SUPERSEDED = "superseded"  # a newer generation of the room exists
    DUPLICATE = "duplicate"  # the room already has (or had) a sender / live receiver here
    TABLE_MISMATCH = "table_mismatch"  # buffer tables or protocol versions do not fit
    # Refused as given: a page or slot out of range, a chunk past the destination, finish
    # without the row this rank must write, an unexpected decode instance, ROOM before HELLO,
    # a registration the bootstrap server refused, or an API call out of order.
    INVALID = "invalid"
    BACKEND = "backend"  # NIXL/UCX reported a failed write or notification
    INTEGRITY = "integrity"  # transfer counts or the metadata row did not check
    SLOTS_EXHAUSTED = "slots_exhausted"  # no free metadata slot
    INTERNAL = "internal"  # unexpected exception in an engine (ours or the peer's)
    FAILED = "failed"  # a peer's code this version does not know (or a peer that sent none)

    @classmethod
    def from_wire(cls, value: object) -> "TransferErrorCode":
        try:
            return cls(value)
        except ValueError:
            return cls.FAILED


class TransferError(RuntimeError):
    """A refused call or a failed room; ``code`` says why."""

    def __init__(self, message: str, code: TransferErrorCode):
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # keep the code across pickling (multiprocessing)
        return (type(self), (str(self), self.code))


@dataclass(frozen=True)
class Failure:
    """A failure cause and its message, recorded before it is applied (abort requests, aborts
    that arrive before their sender, retired rooms)."""

    code: TransferErrorCode
    reason: str


@dataclass(frozen=True)
class Room:
    """A request's transfer identity: ``id`` (u64, assigned by the router) and ``generation``
    (u32, bumped on every retry of the same id). Writes and notices of another generation are
    never accepted for this room."""

    id: int
    generation: int = 0

    def __post_init__(self):
        if not (0 <= self.id < 2 ** 64 and 0 <= self.generation < 2 ** 32):
            raise ValueError(f"room id must be u64 and generation u32, got {self}")

    @property
    def key(self) -> tuple[int, int]:
        return (self.id, self.generation)


@dataclass
class TransportConfig:
    """Timeouts in seconds; all bounded. ``transfer_timeout_s`` runs to the commit from the
    moment prefill admitted the room: for a sender, once it has every decode rank's destination
    (it is created at admission); for a receiver, from prefill's ACCEPTED (or its first data
    notice), so it covers prefill compute and the KV move but not prefill's queue.
    ``bootstrap_timeout_s`` bounds reaching the prefill instance. ``queue_timeout_s`` (None:
    ``bootstrap_timeout_s``) bounds the queue waits on either side, which are not transfer
    faults: a receiver whose room prefill has not accepted that long after it sent its
    destination, a ROOM prefill holds with no sender, and a sender that no decode rank sent its
    destination fail with QUEUE_TIMEOUT. Servers set it past their schedulers' own queue bound
    (router.max_queue_wait_s), so it is a backstop. ``peer_timeout_s`` fails rooms whose peer
    sent nothing (not even a heartbeat) for that long."""

    bootstrap_timeout_s: float = 60.0
    queue_timeout_s: Optional[float] = None
    transfer_timeout_s: float = 300.0
    heartbeat_interval_s: float = 1.0
    peer_timeout_s: float = 10.0
    quiesce_timeout_s: float = 10.0
    query_retry_s: float = 0.2
    host: str = "127.0.0.1"
    meta_slots: int = 1024
    meta_slot_bytes: int = 1024
    num_threads: int = 0  # NIXL UCX backend worker threads (0: NIXL default)
    # NIXL's UCX progress thread busy-polls a core even when idle. Off, this engine's loop
    # progresses UCX (it polls notifications every 1 ms while a room is live), which is what a
    # host shared by several instances wants; on, for dedicated hosts chasing tcp throughput.
    progress_thread: bool = False

    @property
    def queue_s(self) -> float:
        """The queue-wait bound in force (``queue_timeout_s``, else ``bootstrap_timeout_s``)."""
        return self.bootstrap_timeout_s if self.queue_timeout_s is None else self.queue_timeout_s


# ------------------------------------------------------------------------------------------
# Public handles
# ------------------------------------------------------------------------------------------

class _RoomHandle:
    """What both ends of a room share: its state, error, abort and a bounded wait."""

    # "sender" | "receiver": what `RoomTransfer` checks, so a rank in another process can be
    # represented by a proxy with the same methods.
    kind: ClassVar[str] = ""
    _abort_reason = ""

    def __init__(self, engine: "TransferEngine", st: Union["SenderRoom", "ReceiverRoom"]):
        self._e, self._st = engine, st

    @property
    def room(self) -> Room:
        return self._st.room

    def poll(self) -> KVPoll:
        return self._st.state

    @property
    def error(self) -> str:
        return self._st.error

    @property
    def error_code(self) -> Optional[TransferErrorCode]:
        """Why the room failed (set together with ``error``); None while it has not."""
        return self._st.error_code

    def abort(self, reason: str = "") -> None:
        """Fail the room on both sides. ``poll()`` reports FAILED once no write of this room
        can still land (sender: none in flight, so source pages may be freed; receiver: every
        prefill rank that could write acknowledged, died, or the quiesce timeout passed)."""
        with self._e._lock:
            if self._st.abort_req is None:
                self._st.abort_req = Failure(TransferErrorCode.ABORTED,
                                             reason or self._abort_reason)
        self._e._wake()

    def wait(self, timeout: float) -> KVPoll:
        """Poll until terminal or ``timeout`` (tests, tools)."""
        return wait_terminal(self.poll, timeout)


class KVSender(_RoomHandle):
    """Prefill side of one room on one rank. Create with ``TransferEngine.create_sender``."""

    kind: ClassVar[str] = "sender"
    _abort_reason = "aborted by prefill"

    @property
    def last_stage(self) -> bool:
        """This rank is on the last PP stage: its ``finish`` takes the metadata row."""
        return self._e.pp_rank == self._e.pp_size - 1

    def send_pages(self, src_pages, start: Optional[int] = None) -> None:
        """Queue one completed chunk: ``src_pages`` (this rank's page ids, in request order)
        go to the destination pages ``dst_pages[start : start + len(src_pages)]`` of every
        decode rank this rank writes to. ``start`` defaults to where the previous chunk
        ended. May be called before decode's destination info arrived (writes are posted when
        it does). A no-op once the room failed. Chunks must cover whole pages except the
        request's last page; re-sending a page is allowed (it is overwritten). GPU pools: the
        pages may still be being written by work queued on the caller's current CUDA stream;
        their writes are posted only once that work has run."""
        src = np.asarray(src_pages, dtype=np.int64).reshape(-1).copy()
        ready = self._e.stream_marker()
        with self._e._lock:
            queued = self._e._tx.queue_chunk(self._st, src, start, ready)
        if queued:
            self._e._wake()

    def finish(self, row: Optional[MetadataRow] = None) -> None:
        """Declare the last chunk sent. On the last PP stage pass the metadata ``row`` (first
        token ids, counts, payload): it is written after this rank's data, as the commit
        record. Other stages pass nothing."""
        with self._e._lock:
            finished = self._e._tx.finish(self._st, row)
        if finished:
            self._e._wake()

    @property
    def stats(self) -> dict:
        """Transfers posted, descriptors and bytes written by this sender."""
        return dict(self._st.stats)


class KVReceiver(_RoomHandle):
    """Decode side of one room on one rank. Create with ``TransferEngine.create_receiver``."""

    kind: ClassVar[str] = "receiver"
    _abort_reason = "aborted by decode"

    def set_destination(self, pages, meta_slot: Optional[int] = None) -> None:
        """Hand over the destination page ids (request order; the caller allocated them, ideally
        as few contiguous runs) and optionally a metadata slot (else the engine picks one).
        Once the prefill instance is connected, the ranks are told where to write."""
        self._e._rx.set_destination(self._st, pages, meta_slot)

    @property
    def error_field(self) -> str:
        """For a buffer-table mismatch: the field that differs."""
        return self._st.error_field

    def metadata(self) -> MetadataRow:
        """The checked metadata row (room id and generation match). Only after SUCCESS."""
        if self._st.state != KVPoll.SUCCESS or self._st.row is None:
            raise TransferError(f"room {self._st.room}: no metadata (state "
                                f"{self._st.state.name})", TransferErrorCode.INVALID)
        return self._st.row


def wait_terminal(poll: Callable[[], KVPoll], timeout: float) -> KVPoll:
    """Call ``poll`` until it reports a terminal state or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    s = poll()
    while s not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.002)
        s = poll()
    return s
