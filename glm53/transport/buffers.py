"""Buffer table: the per-buffer description exchanged at bootstrap (docs/ARCHITECTURE.md,
"Buffer table and item lengths"). Pure, no I/O.

A *buffer* is one page-major pool of an instance's rank (one PP stage, one TP rank). Its
*page item* is everything the pool holds for one page id, and a run of contiguous page ids is
one contiguous byte range. Two shard kinds:

* ``Replicated()`` — every TP rank holds the whole buffer (MLA latent, DSA indexer keys).
  Item layout ``[n_layers, page_size, bytes_per_token]``.
* ``Heads(total, per_rank, bytes_per_head)`` — head-sharded under TP (DFlash draft K / V).
  Item layout ``[heads_local, n_layers, page_size, bytes_per_head]`` so that a range of local
  heads is one contiguous byte range of the item. ``bytes_per_head`` is per token per layer.
  When ``tp > total`` each head is held by ``tp // total`` ranks (``per_rank == 1``).

``bytes_per_token`` is always per token per layer *of the local shard*; the item length is
derived, never sent separately: ``item_bytes = n_layers * page_size * bytes_per_token``.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, Union


class TableMismatch(ValueError):
    """Two buffer tables (or a table and its topology) disagree. ``field`` names what differs
    (``page_size``, ``dtype``, ``shard``, ``heads.total``, ``heads.per_rank``,
    ``heads.bytes_per_head``, ``bytes_per_token``, ``layers``, ``name``, ``tp``, ``pp``)."""

    def __init__(self, field_name: str, detail: str):
        super().__init__(f"buffer table mismatch in field '{field_name}': {detail}")
        self.field = field_name
        self.detail = detail


@dataclass(frozen=True)
class Replicated:
    kind: str = field(default="replicated", init=False)


@dataclass(frozen=True)
class Heads:
    total: int
    per_rank: int
    bytes_per_head: int
    kind: str = field(default="heads", init=False)

    def replicas(self, tp: int) -> int:
        """How many TP ranks hold each head."""
        return max(1, tp // self.total)

    def head_range(self, tp: int, rank: int) -> tuple[int, int]:
        """Global heads [start, end) held by TP ``rank`` of ``tp``."""
        g = rank // self.replicas(tp)
        return g * self.per_rank, (g + 1) * self.per_rank

    def check_tp(self, tp: int, where: str = "") -> None:
        if self.total < 1 or self.per_rank < 1 or self.bytes_per_head < 1:
            raise TableMismatch("heads.total", f"{where}non-positive head geometry {self}")
        if self.total % tp and tp % self.total:
            raise TableMismatch(
                "heads.total", f"{where}{self.total} heads cannot be split over tp={tp}"
            )
        want = max(1, self.total // tp)
        if self.per_rank != want:
            raise TableMismatch(
                "heads.per_rank",
                f"{where}per_rank={self.per_rank} but {self.total} heads over tp={tp} give {want}",
            )


Shard = Union[Replicated, Heads]

DTYPE_SIZES = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "uint8": 1, "int8": 1, "int32": 4, "int64": 8,
}


def dtype_name(dtype: Any) -> str:
    """'torch.bfloat16' / numpy dtype / str -> 'bfloat16'."""
    s = str(dtype)
    return s.split(".")[-1]


@dataclass(frozen=True)
class BufferSpec:
    """One pool of one rank. ``layers`` are global layer ids in the order of the item's layer
    axis (a PP stage's layers; for indexer keys only the stage's "full" layers)."""

    name: str
    layers: tuple[int, ...]
    bytes_per_token: int
    page_size: int
    dtype: str
    shard: Shard = Replicated()

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(int(x) for x in self.layers))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        if self.page_size < 1 or self.bytes_per_token < 1:
            raise ValueError(f"buffer {self.name}: page_size and bytes_per_token must be >= 1")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"buffer {self.name}: duplicate layer ids")
        if isinstance(self.shard, Heads):
            if self.shard.per_rank * self.shard.bytes_per_head != self.bytes_per_token:
                raise ValueError(
                    f"buffer {self.name}: bytes_per_token {self.bytes_per_token} != "
                    f"per_rank {self.shard.per_rank} x bytes_per_head {self.shard.bytes_per_head}"
                )

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def item_bytes(self) -> int:
        """Bytes of one page item: all of this rank's layers (and local heads) for one page."""
        return self.n_layers * self.page_size * self.bytes_per_token

    def layer_pos(self) -> dict[int, int]:
        return {l: j for j, l in enumerate(self.layers)}

    # -- wire form -------------------------------------------------------------------------
    def to_wire(self) -> dict:
        sh: dict = {"kind": self.shard.kind}
        if isinstance(self.shard, Heads):
            sh.update(total=self.shard.total, per_rank=self.shard.per_rank,
                      bytes_per_head=self.shard.bytes_per_head)
        return {"name": self.name, "layers": list(self.layers),
                "bytes_per_token": self.bytes_per_token, "page_size": self.page_size,
                "dtype": self.dtype, "shard": sh}

    @staticmethod
    def from_wire(d: Mapping) -> "BufferSpec":
        sh = d["shard"]
        shard: Shard = (Heads(sh["total"], sh["per_rank"], sh["bytes_per_head"])
                        if sh["kind"] == "heads" else Replicated())
        return BufferSpec(d["name"], tuple(d["layers"]), d["bytes_per_token"], d["page_size"],
                          d["dtype"], shard)

    @staticmethod
    def for_tensor(name: str, tensor: Any, layers: Sequence[int], shard: Shard = Replicated(),
                   total_heads: int | None = None) -> "BufferSpec":
        """Describe a page-major torch tensor / numpy array.

        Replicated: shape ``[num_pages, n_layers, page_size, *dims]``.
        Heads: shape ``[num_pages, heads_local, n_layers, page_size, head_dim]``; pass
        ``total_heads`` (or a ``Heads`` shard) to get the head geometry.
        """
        shape = tuple(tensor.shape)
        isz = tensor.element_size() if hasattr(tensor, "element_size") else tensor.itemsize
        dt = dtype_name(tensor.dtype)
        if total_heads is not None or isinstance(shard, Heads):
            if len(shape) != 5:
                raise ValueError(f"{name}: head-sharded pool must be 5-D, got {shape}")
            _, hl, nl, ps, hd = shape
            total = total_heads if total_heads is not None else shard.total  # type: ignore
            bph = hd * isz
            return BufferSpec(name, tuple(layers), hl * bph, ps, dt, Heads(total, hl, bph))
        if len(shape) < 3:
            raise ValueError(f"{name}: pool must be [num_pages, n_layers, page_size, ...]")
        nl, ps = shape[1], shape[2]
        bpt = isz
        for s in shape[3:]:
            bpt *= s
        if nl != len(layers):
            raise ValueError(f"{name}: tensor has {nl} layers, {len(layers)} layer ids given")
        return BufferSpec(name, tuple(layers), bpt, ps, dt, Replicated())


@dataclass(frozen=True)
class BufferTable:
    """All buffers of one rank (one PP stage), by name."""

    buffers: tuple[BufferSpec, ...]

    def __post_init__(self):
        names = [b.name for b in self.buffers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate buffer names in table: {names}")
        object.__setattr__(self, "buffers", tuple(sorted(self.buffers, key=lambda b: b.name)))

    def __getitem__(self, name: str) -> BufferSpec:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(name)

    def __contains__(self, name: str) -> bool:
        return any(b.name == name for b in self.buffers)

    def names(self) -> list[str]:
        return [b.name for b in self.buffers]

    def to_wire(self) -> list:
        return [b.to_wire() for b in self.buffers]

    @staticmethod
    def from_wire(w: Iterable) -> "BufferTable":
        return BufferTable(tuple(BufferSpec.from_wire(d) for d in w))

    @staticmethod
    def of(*specs: BufferSpec) -> "BufferTable":
        return BufferTable(tuple(specs))


def check_pair(src: BufferSpec, dst: BufferSpec, src_tp: int, dst_tp: int, where: str = "") -> None:
    """Geometry that both sides of one buffer must agree on (layers are checked globally)."""
    w = f"{where}buffer '{src.name}': "
    if src.page_size != dst.page_size:
        raise TableMismatch("page_size", f"{w}prefill {src.page_size} vs decode {dst.page_size}")
    if src.dtype != dst.dtype:
        raise TableMismatch("dtype", f"{w}prefill {src.dtype} vs decode {dst.dtype}")
    if src.shard.kind != dst.shard.kind:
        raise TableMismatch("shard", f"{w}prefill {src.shard.kind} vs decode {dst.shard.kind}")
    if isinstance(src.shard, Heads):
        assert isinstance(dst.shard, Heads)
        if src.shard.total != dst.shard.total:
            raise TableMismatch("heads.total",
                                f"{w}prefill {src.shard.total} vs decode {dst.shard.total}")
        if src.shard.bytes_per_head != dst.shard.bytes_per_head:
            raise TableMismatch("heads.bytes_per_head", f"{w}prefill {src.shard.bytes_per_head}"
                                f" vs decode {dst.shard.bytes_per_head}")
        src.shard.check_tp(src_tp, f"{w}prefill: ")
        dst.shard.check_tp(dst_tp, f"{w}decode: ")
    elif src.bytes_per_token != dst.bytes_per_token:
        raise TableMismatch("bytes_per_token",
                            f"{w}prefill {src.bytes_per_token} vs decode {dst.bytes_per_token}")


def check_tables(prefill_stages: Sequence[BufferTable], prefill_tp: int,
                 decode: BufferTable, decode_tp: int) -> None:
    """Validate a prefill instance (one table per PP stage) against a decode instance (one
    table, PP 1). Raises ``TableMismatch`` naming the field. Rules: every prefill buffer exists
    on decode (decode may hold more: a buffer this prefill does not fill, such as draft KV from a
    prefill without the draft, simply receives no writes); per-buffer geometry agrees
    (``check_pair``); no layer of a buffer is held by two stages; the stages together hold exactly
    the decode buffer's layers."""
    if prefill_tp < 1 or decode_tp < 1:
        raise TableMismatch("tp", f"prefill tp {prefill_tp}, decode tp {decode_tp}")
    if not prefill_stages:
        raise TableMismatch("pp", "prefill has no stages")
    pnames = set().union(*[set(t.names()) for t in prefill_stages])
    dnames = set(decode.names())
    if not pnames <= dnames:
        raise TableMismatch("name", f"prefill buffers {sorted(pnames - dnames)} are not on decode "
                            f"(prefill {sorted(pnames)}, decode {sorted(dnames)})")
    for name in sorted(pnames):
        d = decode[name]
        owner: dict[int, int] = {}
        for s, t in enumerate(prefill_stages):
            if name not in t:
                continue
            p = t[name]
            check_pair(p, d, prefill_tp, decode_tp, f"stage {s}: ")
            for l in p.layers:
                if l in owner:
                    raise TableMismatch("layers", f"buffer '{name}': layer {l} held by stages "
                                        f"{owner[l]} and {s}")
                owner[l] = s
        if set(owner) != set(d.layers):
            missing = sorted(set(d.layers) - set(owner))
            extra = sorted(set(owner) - set(d.layers))
            raise TableMismatch(
                "layers", f"buffer '{name}': layer count prefill {len(owner)} vs decode "
                f"{len(d.layers)} (missing on prefill {missing[:8]}, not on decode {extra[:8]})")


# ------------------------------------------------------------------------------------------
# Metadata row: the commit record, written last by one prefill rank into each decode rank's
# metadata slot and checked (magic, room id, generation, crc) before decode adopts a request.
# ------------------------------------------------------------------------------------------

META_MAGIC = 0x354D4C47  # b"GLM5" little-endian
_META_HDR = struct.Struct("<IIQIIII")  # magic, version, room, gen, n_tokens, payload_len, crc
META_NCOUNTS = 8
_META_COUNTS = struct.Struct(f"<{META_NCOUNTS}q")
META_HEADER_BYTES = _META_HDR.size + _META_COUNTS.size  # 32 + 64


@dataclass(frozen=True)
class MetadataRow:
    """What prefill hands decode with the KV: the first sampled token id(s), engine-defined
    counts (up to 8 int64, e.g. prompt length, cached tokens), and an opaque payload (e.g.
    logprobs, DFlash seed). ``room_id``/``generation`` are filled by the transport."""

    first_token_ids: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    payload: bytes = b""
    room_id: int = 0
    generation: int = 0

    def encode(self, slot_bytes: int, room_id: int, generation: int) -> bytes:
        counts = tuple(self.counts) + (0,) * (META_NCOUNTS - len(self.counts))
        if len(counts) != META_NCOUNTS:
            raise ValueError(f"at most {META_NCOUNTS} counts")
        body = _META_COUNTS.pack(*counts) + struct.pack(
            f"<{len(self.first_token_ids)}i", *self.first_token_ids) + bytes(self.payload)
        crc = zlib.crc32(body, zlib.crc32(struct.pack("<QI", room_id, generation)))
        hdr = _META_HDR.pack(META_MAGIC, 1, room_id, generation, len(self.first_token_ids),
                             len(self.payload), crc)
        out = hdr + body
        if len(out) > slot_bytes:
            raise ValueError(f"metadata row of {len(out)} B exceeds slot of {slot_bytes} B")
        return out

    @staticmethod
    def decode(buf: bytes | memoryview, room_id: int, generation: int) -> "MetadataRow":
        """Parse and check a slot; raises ValueError when it is not this room's commit record."""
        buf = bytes(buf)
        magic, ver, room, gen, ntok, plen, crc = _META_HDR.unpack_from(buf, 0)
        if magic != META_MAGIC:
            raise ValueError("metadata slot holds no row (bad magic)")
        if room != room_id or gen != generation:
            raise ValueError(f"metadata row is for room {room} gen {gen}, expected room "
                             f"{room_id} gen {generation}")
        end = META_HEADER_BYTES + 4 * ntok + plen
        if end > len(buf):
            raise ValueError("metadata row overruns its slot")
        body = buf[_META_HDR.size:end]
        if zlib.crc32(body, zlib.crc32(struct.pack("<QI", room, gen))) != crc:
            raise ValueError("metadata row checksum mismatch")
        counts = _META_COUNTS.unpack_from(buf, _META_HDR.size)
        toks = struct.unpack_from(f"<{ntok}i", buf, META_HEADER_BYTES)
        payload = buf[META_HEADER_BYTES + 4 * ntok:end]
        return MetadataRow(tuple(toks), tuple(counts), payload, room, gen)
