"""The control protocol as dataclasses, with explicit encoding to msgpack maps, and the UCX
notification attached to each write.

Control messages travel over ZMQ; the map key ``"t"`` names the type:

* bootstrap (prefill rank <-> ``BootstrapServer``; decode rank -> server): ``REGISTER`` /
  ``REGISTERED``, ``UNREGISTER``, ``QUERY`` / ``TOPOLOGY``;
* peer to peer: ``HELLO`` / ``HELLO_ACK`` (once per decode rank and prefill rank: tables,
  regions, routes), ``ROOM`` (per request: where to write), ``ACCEPTED`` (prefill -> decode:
  the room left prefill's queue), ``ABORT`` (decode -> prefill), ``FAIL`` / ``QUIESCED``
  (prefill -> decode), ``PING`` / ``PONG`` (liveness).

Failure messages carry a ``TransferErrorCode`` (key ``"code"``; a peer that sends none, or one
this version does not know, reads as ``FAILED``). A message of another protocol version is read
only as far as its version and the fields needed to answer it, since its layout may differ.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Optional

import msgpack
import numpy as np

from .handles import Room, TransferErrorCode
from .mapping import Segment

# 2: ACCEPTED (decode's transfer clock starts at prefill's admission, not at ROOM).
PROTOCOL_VERSION = 2


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(b: bytes) -> dict:
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


def _room(m: Mapping) -> Room:
    return Room(m["room"], m["gen"])


def _code(m: Mapping) -> TransferErrorCode:
    return TransferErrorCode.from_wire(m.get("code"))


# ------------------------------------------------------------------------------------------
# Records inside messages
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RankInfo:
    """One prefill rank as registered at its bootstrap server. ``table`` stays in its wire form
    (``BufferTable.to_wire()``): the server only forwards it, decode parses and checks it."""

    pp: int
    tp: int
    ep: str  # control endpoint (ZMQ ROUTER)
    agent: str  # NIXL agent name
    agent_md: bytes
    table: Any

    def to_wire(self) -> dict:
        return {"pp": self.pp, "tp": self.tp, "ep": self.ep, "agent": self.agent,
                "agent_md": self.agent_md, "table": self.table}

    @classmethod
    def from_wire(cls, m: Mapping) -> "RankInfo":
        return cls(m["pp"], m["tp"], m["ep"], m["agent"], m["agent_md"], m["table"])


@dataclass(frozen=True)
class RemoteRegion:
    """One registered pool of a decode rank, as a prefill rank writes into it."""

    addr: int
    item_bytes: int
    num_pages: int
    mem: str  # "DRAM" | "VRAM"
    device: int

    def to_wire(self) -> list:
        return [self.addr, self.item_bytes, self.num_pages, self.mem, self.device]

    @classmethod
    def from_wire(cls, w) -> "RemoteRegion":
        return cls(*w)


@dataclass(frozen=True)
class MetaSlotRegion:
    """A decode rank's metadata-slot array: ``nslots`` slots of ``slot_bytes`` at ``addr``."""

    addr: int
    slot_bytes: int
    nslots: int
    mem: str
    device: int

    def to_wire(self) -> list:
        return [self.addr, self.slot_bytes, self.nslots, self.mem, self.device]

    @classmethod
    def from_wire(cls, w) -> "MetaSlotRegion":
        return cls(*w)


# ------------------------------------------------------------------------------------------
# Messages
# ------------------------------------------------------------------------------------------

class Message(abc.ABC):
    T: ClassVar[str]

    @abc.abstractmethod
    def to_wire(self) -> dict:
        ...

    def encode(self) -> bytes:
        return pack(self.to_wire())


@dataclass(frozen=True)
class Register(Message):
    """Prefill rank -> bootstrap server. ``rank`` is None only for another protocol version."""

    T: ClassVar[str] = "REGISTER"
    version: Any
    instance: str = ""
    pp_size: int = 0
    tp_size: int = 0
    rank: Optional[RankInfo] = None

    def to_wire(self) -> dict:
        return {"t": self.T, "v": self.version, "instance": self.instance,
                "pp_size": self.pp_size, "tp_size": self.tp_size, **self.rank.to_wire()}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Register":
        if m.get("v") != PROTOCOL_VERSION:
            return cls(m.get("v"))
        return cls(m["v"], m["instance"], m["pp_size"], m["tp_size"], RankInfo.from_wire(m))


@dataclass(frozen=True)
class Registered(Message):
    T: ClassVar[str] = "REGISTERED"
    ok: bool
    error: str = ""

    def to_wire(self) -> dict:
        return {"t": self.T, "ok": self.ok, "error": self.error}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Registered":
        return cls(m["ok"], m["error"])


@dataclass(frozen=True)
class Unregister(Message):
    T: ClassVar[str] = "UNREGISTER"
    pp: int
    tp: int

    def to_wire(self) -> dict:
        return {"t": self.T, "pp": self.pp, "tp": self.tp}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Unregister":
        return cls(m["pp"], m["tp"])


@dataclass(frozen=True)
class Query(Message):
    T: ClassVar[str] = "QUERY"

    def to_wire(self) -> dict:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Query":
        return cls()


@dataclass(frozen=True)
class Topology(Message):
    """Bootstrap server -> decode rank: the instance's ranks once all registered
    (``complete``; before that ``ranks`` is empty)."""

    T: ClassVar[str] = "TOPOLOGY"
    version: Any
    complete: bool
    instance: str = ""
    pp_size: int = 0
    tp_size: int = 0
    ranks: tuple[RankInfo, ...] = ()

    def to_wire(self) -> dict:
        return {"t": self.T, "v": self.version, "complete": self.complete,
                "instance": self.instance, "pp_size": self.pp_size, "tp_size": self.tp_size,
                "ranks": [r.to_wire() for r in self.ranks]}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Topology":
        if m.get("v") != PROTOCOL_VERSION:
            return cls(m.get("v"), bool(m.get("complete")))
        return cls(m["v"], bool(m.get("complete")), m["instance"], m["pp_size"], m["tp_size"],
                   tuple(RankInfo.from_wire(r) for r in m["ranks"]))


@dataclass(frozen=True)
class Hello(Message):
    """Decode rank -> prefill rank, once per pair: the decode rank's agent, table, pool regions,
    metadata slots, the byte routes this prefill rank writes to it, and whether it writes the
    metadata row. ``addr`` is the bootstrap address the decode rank knows the instance by."""

    T: ClassVar[str] = "HELLO"
    version: Any
    inst: str
    drank: int
    addr: str
    dtp: int = 0
    agent: str = ""
    agent_md: bytes = b""
    table: Any = None  # BufferTable wire form, checked by the prefill rank
    regions: dict = field(default_factory=dict)  # name -> RemoteRegion
    meta: Optional[MetaSlotRegion] = None
    routes: tuple[Segment, ...] = ()
    writer: bool = False

    def to_wire(self) -> dict:
        return {"t": self.T, "v": self.version, "inst": self.inst, "addr": self.addr,
                "dtp": self.dtp, "drank": self.drank, "agent": self.agent,
                "agent_md": self.agent_md, "table": self.table,
                "regions": {n: r.to_wire() for n, r in self.regions.items()},
                "meta": self.meta.to_wire(), "routes": [g.to_wire() for g in self.routes],
                "writer": self.writer}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Hello":
        head = (m.get("v"), m["inst"], m["drank"], m["addr"])
        if m.get("v") != PROTOCOL_VERSION:
            return cls(*head)
        return cls(*head, m["dtp"], m["agent"], m["agent_md"], m["table"],
                   {k: RemoteRegion.from_wire(v) for k, v in m["regions"].items()},
                   MetaSlotRegion.from_wire(m["meta"]),
                   tuple(Segment.from_wire(w) for w in m["routes"]), bool(m["writer"]))


@dataclass(frozen=True)
class HelloAck(Message):
    """Prefill rank -> decode rank: HELLO accepted, or refused with the table ``field`` that
    differs (empty when the refusal is not a table mismatch) and a code."""

    T: ClassVar[str] = "HELLO_ACK"
    ok: bool
    pp: int
    tp: int
    addr: str
    field: str = ""
    error: str = ""
    code: Optional[TransferErrorCode] = None

    def to_wire(self) -> dict:
        m = {"t": self.T, "ok": self.ok, "pp": self.pp, "tp": self.tp, "addr": self.addr}
        if not self.ok:
            m.update(field=self.field, error=self.error, code=self.code.value)
        return m

    @classmethod
    def from_wire(cls, m: Mapping) -> "HelloAck":
        if m["ok"]:
            return cls(True, m["pp"], m["tp"], m.get("addr"))
        return cls(False, m["pp"], m["tp"], m.get("addr"), m.get("field", ""), m["error"],
                   _code(m))


@dataclass(frozen=True)
class RoomDestination(Message):
    """Decode rank -> every prefill rank, per request: the destination pages (request order)
    and the metadata slot of this decode rank for ``room``."""

    T: ClassVar[str] = "ROOM"
    room: Room
    inst: str
    dtp: int
    drank: int
    pages: np.ndarray  # int64 page ids
    slot: int

    def to_wire(self) -> dict:
        return {"t": self.T, "room": self.room.id, "gen": self.room.generation,
                "inst": self.inst, "dtp": self.dtp, "drank": self.drank,
                "pages": self.pages.tobytes(), "slot": self.slot}

    @classmethod
    def from_wire(cls, m: Mapping) -> "RoomDestination":
        return cls(_room(m), m["inst"], int(m["dtp"]), int(m["drank"]),
                   np.frombuffer(m["pages"], dtype=np.int64), int(m["slot"]))


@dataclass(frozen=True)
class _FromRank(Message):
    """A notice about one room from one prefill rank (its stage and tp rank)."""

    room: Room
    pp: int
    tp: int

    def to_wire(self) -> dict:
        return {"t": self.T, "room": self.room.id, "gen": self.room.generation, "pp": self.pp,
                "tp": self.tp}

    @classmethod
    def from_wire(cls, m: Mapping):
        return cls(_room(m), m["pp"], m["tp"])


@dataclass(frozen=True)
class Accepted(_FromRank):
    """Prefill rank -> decode rank: the room's sender exists (prefill admitted the request) and
    has this decode rank's destination. Decode's transfer clock starts here; the wait before
    it is prefill's queue, bounded separately (docs/ARCHITECTURE.md, "Transfer lifecycle")."""

    T: ClassVar[str] = "ACCEPTED"


@dataclass(frozen=True)
class Abort(Message):
    """Decode rank -> prefill ranks: the room failed on decode (``code``, ``reason``)."""

    T: ClassVar[str] = "ABORT"
    room: Room
    drank: Optional[int]
    reason: Optional[str]
    code: TransferErrorCode

    def to_wire(self) -> dict:
        return {"t": self.T, "room": self.room.id, "gen": self.room.generation,
                "drank": self.drank, "reason": self.reason, "code": self.code.value}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Abort":
        return cls(_room(m), m.get("drank"), m.get("reason"), _code(m))


@dataclass(frozen=True)
class Fail(Message):
    """Prefill rank -> decode rank: the room failed on prefill. ``quiesced``: no write of the
    room is in flight from this rank any more (else a QUIESCED follows)."""

    T: ClassVar[str] = "FAIL"
    room: Room
    pp: int
    tp: int
    reason: Optional[str]
    quiesced: bool
    code: TransferErrorCode

    def to_wire(self) -> dict:
        return {"t": self.T, "room": self.room.id, "gen": self.room.generation, "pp": self.pp,
                "tp": self.tp, "reason": self.reason, "quiesced": self.quiesced,
                "code": self.code.value}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Fail":
        return cls(_room(m), m["pp"], m["tp"], m.get("reason"), bool(m.get("quiesced")),
                   _code(m))


@dataclass(frozen=True)
class Quiesced(_FromRank):
    """Prefill rank -> decode rank: no write of ``room`` can land from this rank any more."""

    T: ClassVar[str] = "QUIESCED"


@dataclass(frozen=True)
class Ping(Message):
    T: ClassVar[str] = "PING"

    def to_wire(self) -> dict:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Ping":
        return cls()


@dataclass(frozen=True)
class Pong(Message):
    T: ClassVar[str] = "PONG"

    def to_wire(self) -> dict:
        return {"t": self.T}

    @classmethod
    def from_wire(cls, m: Mapping) -> "Pong":
        return cls()


_TYPES: dict[str, type] = {c.T: c for c in (
    Register, Registered, Unregister, Query, Topology, Hello, HelloAck, RoomDestination,
    Accepted, Abort, Fail, Quiesced, Ping, Pong)}


def decode_message(m: Mapping) -> Optional[Message]:
    """The message for an unpacked map; None when its type is unknown. Raises (KeyError,
    ValueError, ...) on a malformed message of a known type."""
    cls = _TYPES.get(m.get("t"))
    return None if cls is None else cls.from_wire(m)


# ------------------------------------------------------------------------------------------
# Notifications
# ------------------------------------------------------------------------------------------

_NOTIF_TAG = "g53"


@dataclass(frozen=True)
class Notif:
    """Attached to a write and delivered with it: kind ``"D"`` (one data transfer of this
    sender landed) or ``"F"`` (completion: the sender posted ``n`` data transfers to this
    decode rank; ``meta``: this write carried the metadata row)."""

    kind: str
    room: Room
    pp: int
    tp: int
    n: int = 0
    meta: bool = False

    def encode(self) -> bytes:
        return msgpack.packb([_NOTIF_TAG, self.kind, self.room.id, self.room.generation,
                              self.pp, self.tp, self.n, int(self.meta)])

    @classmethod
    def decode(cls, raw: bytes) -> "Notif":
        """Raises ValueError when ``raw`` is not one of ours."""
        try:
            tag, kind, rid, gen, pp, tp, n, meta = msgpack.unpackb(raw)
        except Exception as e:
            raise ValueError(f"not a transfer notification: {e}") from None
        if tag != _NOTIF_TAG:
            raise ValueError("not a transfer notification")
        return cls(kind, Room(rid, gen), pp, tp, n, bool(meta))
