"""glm53.transport — KV transfer between prefill and decode ranks over UCX (through NIXL).

Prefill ranks write target KV (MLA latent), DSA indexer keys and DFlash draft K/V straight into
the pages decode allocated, one-sided, whatever the two sides' TP sizes and however prefill is
split into PP stages (docs/ARCHITECTURE.md, "Buffer table and item lengths" and "Transfer
lifecycle").

Pieces
------
* ``buffers`` (pure): ``BufferSpec`` / ``BufferTable`` — per pool: name, global layer ids of the
  item's layer axis, bytes per token per layer of the local shard, page size, dtype, shard
  (``Replicated()`` or ``Heads(total, per_rank, bytes_per_head)``); item length is derived.
  ``check_tables`` rejects mismatches with ``TableMismatch`` naming the field.
  ``MetadataRow`` is the commit record (first token ids, counts, payload; room id + generation
  + crc checked by decode).
* ``mapping`` (pure): ``plan_transfers(prefill_stage_tables, prefill_tp, decode_table,
  decode_tp)`` -> ``TransferPlan``: for each (stage, prefill tp rank, decode tp rank) the byte
  segments inside a page item; replicated buffers are sent to each decode rank by exactly one
  source (spread over sources); ``page_runs`` / ``segment_descs`` turn page lists into
  descriptors — one per contiguous page run when the segment is a whole item.
* ``backend``: ``TransferBackend`` protocol and ``NixlBackend`` (register host/CUDA memory, add
  peer, prepare descriptors, post write with notification, poll, abort, deregister);
  ``import_nixl()`` prefers ``nixl_cu13`` over ``nixl_cu12``.
* ``messages``: the control protocol as dataclasses with explicit msgpack encoding (REGISTER,
  TOPOLOGY, HELLO, ROOM, ACCEPTED, ABORT, FAIL, QUIESCED, PING, ...), the records inside them,
  and the notification attached to each write.
* ``bootstrap``: ``BootstrapServer`` (ZMQ ROUTER) — the registry of one prefill instance's
  ranks (endpoint, agent metadata, buffer table). Carries no data.
* ``handles``: what callers hold — ``Room``, ``KVPoll`` / ``TERMINAL``, ``TransportConfig``,
  ``TransferErrorCode``, ``TransferError``, and the per-room handles ``KVSender`` /
  ``KVReceiver``.
* ``engine``: ``TransferEngine``, one per rank — the core: NIXL agent, registered pools,
  metadata slots, ZMQ control sockets, the progress thread, peer liveness. It delegates to its
  role object:
* ``sender``: ``SenderSide``, prefill's state machine (decode peers, sender rooms, posting
  chunks, the metadata row last, quiesce);
* ``receiver``: ``ReceiverSide``, decode's state machine (bootstrap to the prefill ranks,
  destinations, notifications, the done check, failures).
* ``ranks``: ``combine_polls`` and ``RoomTransfer`` — one room across an instance's ranks
  (TP x PP, one engine and one handle each); its pages are freed only when all are terminal.

Errors: a failed room has ``error`` (a message) and ``error_code`` (``TransferErrorCode``), set
where the failure is raised; a room failed by its peer reports the peer's code, carried in the
FAIL / ABORT message. ``TransferError`` carries a ``code`` too.

Pool layout (page-major; one page-id space for all pools of an instance)
-----------------------------------------------------------------------
latent ``[num_pages, n_layers_of_stage, page_size, 576]``, indexer keys ``[num_pages,
n_full_indexer_layers_of_stage, page_size, 128 or 132 B]``, draft K / V ``[num_pages,
heads_local, n_draft_layers, page_size, head_dim]``. A run of contiguous pages of one pool is one
descriptor when source and destination items are identical (PP 1 prefill, or a decode pool split
at the prefill stage boundaries); otherwise one descriptor per page per pool (never per layer,
never per token). So descriptors per request <= buffers x stages x page runs (or x pages).

States (``KVPoll``): BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS | FAILED.
Terminal states are reported only when it is safe to free the pages: SUCCESS means every
expected sender's writes landed and the metadata row checked; FAILED means no write of this room
can still land (every prefill rank that could write acknowledged, died, or the quiesce timeout
passed). Every wait is bounded (``TransportConfig``: bootstrap, transfer, peer liveness,
quiesce timeouts).

Room generations: a room is ``Room(id: u64, generation: u32)``; a retry bumps the generation.
All messages, notifications and the metadata row carry both; a notice or row of another
generation is ignored (counted in ``engine.stale_notifs``), and a newer generation on prefill
fails the older sender ("superseded"). Decode frees a failed room's pages only once the prefill
ranks quiesced, so a stale write can never land in reused pages.

Decode side (one receiver per request per decode rank)::

    eng = TransferEngine("decode", "d0", tp_size=2, tp_rank=r, config=TransportConfig())
    for name, pool in pools:                    # glm53.models.KVPools: latent, index_k, ...
        eng.register_pool(name, pool.tensor, layers=pool.layers)
    eng.register_pool("draft_k", draft_k, layers=draft_layers, total_heads=n_draft_heads)
    eng.start()
    eng.connect(bootstrap_addr)                 # optional: fail fast on a table mismatch
    pages = allocator.alloc(n_pages)            # ideally a few contiguous runs
    rx = eng.create_receiver(Room(rid, gen), bootstrap_addr, dst_pages=pages)
    ...                                         # each scheduler step:
    s = rx.poll()
    if s == KVPoll.SUCCESS:
        row = rx.metadata()                     # first_token_ids, counts, payload (checked)
    elif s == KVPoll.FAILED:
        allocator.free(pages)                   # safe: nothing can land any more
        report(rx.error_code, rx.error)         # e.g. TransferErrorCode.TRANSFER_TIMEOUT
    rx.abort()                                  # client went away (FAILED follows, then free)

Prefill side (one sender per request per prefill rank, every stage and TP rank)::

    srv = BootstrapServer("p0", pp_size, tp_size)          # once per prefill instance
    eng = TransferEngine("prefill", "p0", tp_size, tp_rank, pp_size, pp_rank)
    eng.register_pool("latent", kv.latent, layers=kv.spec.layers) ...
    eng.start(srv.address)
    tx = eng.create_sender(Room(rid, gen))
    tx.send_pages(chunk_src_pages)              # after each chunk's forward (request order)
    tx.finish(MetadataRow((first_token,), (prompt_len,)) if last_stage else None)
    tx.poll()  # SUCCESS: source pages may be freed; FAILED: tx.error_code / tx.error say why
    tx.abort()

Several ranks of one instance (one engine and one handle per rank)::

    rt = RoomTransfer([eng.create_receiver(room, bootstrap_addr, pages) for eng in engines])
    rt.poll()      # combine_polls over the ranks: terminal only once every rank is
    rt.metadata()  # after SUCCESS; the ranks' rows must agree (else FAILED, INTEGRITY)
    # prefill: RoomTransfer(senders).send_pages(chunk) / .finish(row) fan out to every rank

``engine.close()`` fails live rooms (notifying peers), stops the thread, deregisters memory.
"""

from .backend import BackendError, MemRegion, NixlBackend, TransferBackend, import_nixl
from .bootstrap import BootstrapServer, query_topology
from .buffers import (BufferSpec, BufferTable, Heads, MetadataRow, Replicated, TableMismatch,
                      check_tables)
from .engine import TransferEngine
from .handles import (TERMINAL, KVPoll, KVReceiver, KVSender, Room, TransferError,
                      TransferErrorCode, TransportConfig)
from .mapping import (Segment, TransferPlan, count_descriptors, page_runs, plan_transfers,
                      segment_descs)
from .ranks import RoomTransfer, combine_polls

__all__ = [
    "BackendError", "MemRegion", "NixlBackend", "TransferBackend", "import_nixl",
    "BootstrapServer", "query_topology",
    "BufferSpec", "BufferTable", "Heads", "MetadataRow", "Replicated", "TableMismatch",
    "check_tables",
    "TransferEngine",
    "KVPoll", "TERMINAL", "KVReceiver", "KVSender", "Room", "TransferError", "TransferErrorCode",
    "TransportConfig",
    "Segment", "TransferPlan", "count_descriptors", "page_runs", "plan_transfers",
    "segment_descs",
    "RoomTransfer", "combine_polls",
]
