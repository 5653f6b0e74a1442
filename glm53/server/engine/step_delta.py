"""A step's batch as the follower ranks receive it: only what changed since the last one.

The scheduler hands its `WorkerGroup` a whole batch every step — `SeqChunk`s or `DraftBlock`s,
each carrying its request's full page table. A decode step changes little of that: one token
and one position per request. Page tables change only when a request joins, leaves, is given
more pages, or has its pages replaced. So rank 0 keeps a mirror of the tables the followers
hold (`DeltaEncoder`) and sends per step a `BatchDelta`:

- `leaves`: the tables no row of this step uses (a finished, aborted or preempted request);
- `joins`: a table the followers do not hold, whole, under a fresh id — or new contents for an
  id whose pages were replaced;
- `appends`: pages added at the end of a held table;
- the rows: per chunk its table's id, start position, token count and flags, with the tokens in
  one array (per draft block: id, last token, positions, block size).

Each follower applies the same edits to its own tables (`DeltaDecoder`) and rebuilds the batch,
equal to the scheduler's (tests/server/test_step_delta.py checks it on random event sequences).

The mirror is keyed by the scheduler's page-table list object — the scheduler passes a
request's `pages` list itself every step — and holds a reference to it, so no other list can
take its id while the entry lives. The key only finds the entry: whether the followers' copy is
still right is decided by comparing contents (a shallow copy, so an unchanged table compares by
identity, element by element, at C speed), so a table edited in place is still seen. A table the
scheduler rebuilds as a new list every step would be resent whole every step: correct, not lean.

Ranks sample nothing from the target (rank 0 samples from the logits it returns). A draft block
carries its request key (the MTP draft's per-request state) and, for a sampled request, its
drafting (`DraftSampling`: every rank must draw the same proposals from the same seed, or the
ranks would verify different tokens), and on a request's first step the MTP draft's seed (the
prompt's last hidden row from prefill: every rank runs the same catch-up row from it). A step
without a batch (`sync`) changes nothing.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Optional, Sequence

from glm53.models import SeqChunk
from glm53.models.draft import DraftBlock, DraftSampling
from glm53.models.readback import readback

MICRO, SPEC = 1, 2  # BatchDelta.kind: forward micro-batches, a speculative step


@dataclass
class BatchDelta:
    """One step's batch on the wire (pickled; the arrays pickle as raw bytes). The rows go
    column by column: MICRO — table id, start_pos, token count, all_logits, with every chunk's
    tokens in row order in `tokens`; SPEC — table id, last_token, start_pos, ctx_start,
    block_size (-1: the draft's own), key (-1: none); the sampled blocks' drafting in `sampled`
    (row, temperature, top_k, top_p, min_p, seed)."""

    leaves: list[int] = field(default_factory=list)
    joins: list[tuple[int, list[int]]] = field(default_factory=list)
    appends: list[tuple[int, list[int]]] = field(default_factory=list)
    kind: int = 0  # 0: no batch
    cols: list[array] = field(default_factory=list)
    tokens: array = field(default_factory=lambda: array("q"))
    sizes: list[int] = field(default_factory=list)  # MICRO: chunks per micro-batch
    sampled: list[tuple] = field(default_factory=list)  # SPEC: (row, temperature, top_k, top_p, min_p, seed)
    seeds: list[tuple] = field(default_factory=list)  # SPEC: (row, the MTP seed's hidden row [H] on the host)


@dataclass
class _Held:
    sid: int
    table: list[int]  # the scheduler's list: held so that its id names this entry only
    pages: list[int]  # what the followers hold (a copy taken when it was sent)


class DeltaEncoder:
    """Rank 0's side: what the followers hold, and the delta that brings them to a batch."""

    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}  # id(scheduler's table) -> entry
        self._next_sid = 0

    @property
    def tables(self) -> dict[int, list[int]]:
        """Table id -> pages, as the followers hold them after the last delta."""
        return {e.sid: e.pages for e in self._held.values()}

    def encode(self, microbatches: Optional[list[list[SeqChunk]]], spec: Optional[list[DraftBlock]]) -> BatchDelta:
        if not microbatches and not spec:
            return BatchDelta()
        seen: dict[int, _Held] = {}
        delta = BatchDelta()

        def sid_of(table: list[int]) -> int:
            key = id(table)
            e = seen.get(key)
            if e is not None:  # the same list again in this step (a prompt's chunks in consecutive micro-batches)
                return e.sid
            e = self._held.get(key)
            if e is None:
                e = _Held(self._next_sid, table, list(table))
                self._next_sid += 1
                delta.joins.append((e.sid, e.pages))
            elif e.pages != table:
                n = len(e.pages)
                if len(table) > n and table[:n] == e.pages:
                    delta.appends.append((e.sid, table[n:]))
                else:
                    delta.joins.append((e.sid, list(table)))
                e.pages = list(table)
            seen[key] = e
            return e.sid

        # Column by column: one list comprehension per field is several times cheaper than a
        # tuple per row (256 running requests: the encode and the rebuild stay well under 1 ms).
        if microbatches:
            delta.kind = MICRO
            rows = [c for mb in microbatches for c in mb]
            delta.sizes = [len(mb) for mb in microbatches]
            delta.cols = [array("q", [sid_of(c.page_table) for c in rows]), array("q", [c.start_pos for c in rows]),
                          array("q", [len(c.token_ids) for c in rows]), array("b", [c.all_logits for c in rows])]
            delta.tokens = array("q", [t for c in rows for t in c.token_ids])
        else:
            delta.kind = SPEC
            delta.cols = [array("q", [sid_of(b.page_table) for b in spec]), array("q", [b.last_token for b in spec]),
                          array("q", [b.start_pos for b in spec]), array("q", [b.ctx_start for b in spec]),
                          array("q", [-1 if b.block_size is None else b.block_size for b in spec]),
                          array("q", [-1 if b.key is None else b.key for b in spec])]
            delta.sampled = [(i, s.temperature, s.top_k, s.top_p, s.min_p, s.seed)
                             for i, b in enumerate(spec) if (s := b.sampling) is not None]
            delta.seeds = [(i, readback(b.seed_hidden)) for i, b in enumerate(spec) if b.seed_hidden is not None]
        delta.leaves = [e.sid for key, e in self._held.items() if key not in seen]
        self._held = seen
        return delta


class DeltaDecoder:
    """A follower's side: its own copy of the tables, and the batch rebuilt from a delta."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def decode(self, delta: BatchDelta) -> tuple[Optional[list[list[SeqChunk]]], Optional[list[DraftBlock]]]:
        """(micro-batches, draft blocks), one of them or neither set. A delta that names a
        table this rank does not hold means the two sides diverged: that raises."""
        t = self.tables
        try:
            for sid in delta.leaves:
                del t[sid]
            for sid, pages in delta.joins:
                t[sid] = pages
            for sid, more in delta.appends:
                t[sid] = t[sid] + more  # a new list: a chunk handed out earlier keeps what it had
        except KeyError as e:
            raise RuntimeError(f"step delta names table {e} that this rank does not hold") from None
        cols = [c.tolist() for c in delta.cols]
        if delta.kind == MICRO:
            sids, starts, counts, flags = cols
            tokens = delta.tokens.tolist()
            if len(tokens) == len(sids):  # one token per chunk: a decode step
                chunks = [SeqChunk([tok], start, t[sid], bool(f)) for sid, start, tok, f in zip(sids, starts, tokens, flags)]
            else:
                ends = list(accumulate(counts))
                chunks = [SeqChunk(tokens[e - n : e], start, t[sid], bool(f))
                          for sid, start, n, e, f in zip(sids, starts, counts, ends, flags)]
            return _split(chunks, delta.sizes), None
        if delta.kind == SPEC:
            blocks = [DraftBlock(last_token=last, start_pos=start, page_table=t[sid], ctx_start=ctx,
                                 block_size=None if bs < 0 else bs, key=None if key < 0 else key)
                      for sid, last, start, ctx, bs, key in zip(*cols)]
            for i, *s in delta.sampled:
                blocks[i].sampling = DraftSampling(*s)
            for i, h in delta.seeds:
                blocks[i].seed_hidden = h
            return None, blocks
        return None, None


def _split(chunks: list[SeqChunk], sizes: Sequence[int]) -> list[list[SeqChunk]]:
    out, o = [], 0
    for n in sizes:
        out.append(chunks[o : o + n])
        o += n
    return out
