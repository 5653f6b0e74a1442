"""One room across the ranks of an instance.

An instance runs several ranks (TP ranks x PP stages), each with its own ``TransferEngine`` and
its own handle for a room. The room's pages may be freed only when every rank's handle is
terminal: ``combine_polls`` folds the ranks' states into one, and ``RoomTransfer`` wraps the
handles so the scheduler treats the room as one transfer.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from .buffers import MetadataRow
from .handles import (TERMINAL, KVPoll, KVReceiver, KVSender, Room, TransferError,
                      TransferErrorCode, wait_terminal)

Handle = Union[KVSender, KVReceiver]


def combine_polls(states: Sequence[KVPoll]) -> KVPoll:
    """The state of a room from its ranks' states: terminal only when every rank is terminal
    (then FAILED if any failed, else SUCCESS); otherwise the least advanced non-terminal
    state, so a rank that failed early does not free pages another rank may still receive."""
    if not states:
        raise ValueError("combine_polls needs at least one state")
    if all(s in TERMINAL for s in states):
        return KVPoll.FAILED if KVPoll.FAILED in states else KVPoll.SUCCESS
    return min(s for s in states if s not in TERMINAL)


class RoomTransfer:
    """One room's handles, one per rank, all senders or all receivers of the same room.

    ``poll()`` is ``combine_polls`` over the ranks. ``error`` / ``error_code`` are those of the
    first rank seen failed (ranks seen failed by the same poll: the lowest index). For
    receivers, the metadata rows of all ranks must agree: when every rank succeeded but the rows
    differ, the room is FAILED with code ``INTEGRITY``. Other ranks are not aborted when one
    fails: the transport tells their peers (and through them the other ranks) itself, and
    ``abort`` is there to do it at once."""

    def __init__(self, handles: Sequence[Handle]):
        hs = tuple(handles)
        if not hs:
            raise ValueError("RoomTransfer needs at least one handle")
        kinds = {getattr(h, "kind", None) for h in hs}
        if kinds not in ({"sender"}, {"receiver"}):
            raise TypeError("RoomTransfer takes only senders or only receivers")
        rooms = {h.room for h in hs}
        if len(rooms) != 1:
            raise ValueError(f"handles of different rooms: {sorted(r.key for r in rooms)}")
        self.handles: tuple[Handle, ...] = hs
        self._failed: list[int] = []  # rank indices, in the order their failure was seen
        self._mismatch = ""  # receivers: why the ranks' metadata rows disagree

    @property
    def room(self) -> Room:
        return self.handles[0].room

    def poll(self) -> KVPoll:
        states = [h.poll() for h in self.handles]
        for i, s in enumerate(states):
            if s == KVPoll.FAILED and i not in self._failed:
                self._failed.append(i)
        state = combine_polls(states)
        if state == KVPoll.SUCCESS and self.handles[0].kind == "receiver":
            if not self._mismatch:
                self._mismatch = self._rows_disagree()
            if self._mismatch:
                return KVPoll.FAILED
        return state

    @property
    def error(self) -> str:
        self.poll()
        if self._failed:
            return self.handles[self._failed[0]].error
        return self._mismatch

    @property
    def error_code(self) -> Optional[TransferErrorCode]:
        self.poll()
        if self._failed:
            return self.handles[self._failed[0]].error_code
        return TransferErrorCode.INTEGRITY if self._mismatch else None

    def abort(self, reason: str = "") -> None:
        """Abort the room on every rank (FAILED follows once no rank can still be written)."""
        for h in self.handles:
            h.abort(reason)

    def wait(self, timeout: float) -> KVPoll:
        """Poll until terminal or ``timeout`` (tests, tools)."""
        return wait_terminal(self.poll, timeout)

    # -- senders --------------------------------------------------------------------------
    def send_pages(self, src_pages, start: Optional[int] = None) -> None:
        """``KVSender.send_pages`` on every rank (an instance's ranks share page ids)."""
        for h in self._senders("send_pages"):
            h.send_pages(src_pages, start)

    def finish(self, row: Optional[MetadataRow] = None) -> None:
        """``KVSender.finish`` on every rank; only last-stage ranks get the ``row``."""
        for h in self._senders("finish"):
            h.finish(row if h.last_stage else None)

    # -- receivers ------------------------------------------------------------------------
    def set_destination(self, pages, meta_slot: Optional[int] = None) -> None:
        """``KVReceiver.set_destination`` on every rank."""
        for h in self._receivers("set_destination"):
            h.set_destination(pages, meta_slot)

    def metadata(self) -> MetadataRow:
        """The metadata row, once every rank succeeded and all their rows agree."""
        receivers = self._receivers("metadata")
        state = self.poll()
        if self._mismatch:
            raise TransferError(self._mismatch, TransferErrorCode.INTEGRITY)
        if state != KVPoll.SUCCESS:
            raise TransferError(f"room {self.room}: no metadata (state {state.name})",
                                TransferErrorCode.INVALID)
        return receivers[0].metadata()

    def _rows_disagree(self) -> str:
        rows = [h.metadata() for h in self.handles]
        for i, row in enumerate(rows[1:], 1):
            if row != rows[0]:
                return (f"room {self.room}: metadata rows disagree across ranks: rank 0 has "
                        f"{rows[0]}, rank {i} has {row}")
        return ""

    def _senders(self, what: str) -> tuple[KVSender, ...]:
        if self.handles[0].kind != "sender":
            raise TypeError(f"{what} is for sender handles")
        return self.handles

    def _receivers(self, what: str) -> tuple[KVReceiver, ...]:
        if self.handles[0].kind != "receiver":
            raise TypeError(f"{what} is for receiver handles")
        return self.handles
