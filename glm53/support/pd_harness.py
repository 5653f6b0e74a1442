"""One prompt prefilled by a real prefill instance's ranks (pp stages × tp ranks: `LocalWorkers`,
or `ProcessWorkers` with gloo/NCCL rank processes) into one real decode rank in its own process
(as in serving, so each side has its own CUDA context and NIXL agent), through real transfers.
Used by tests (CPU) and by the GPU benchmarks (benchmarks/gpu_pp.py), which is why it lives in
glm53.support.

`prefill_into_decode` returns the first token as prefill sampled it and as decode's commit record
carried it, decode's pages of every pool (on the host), and per prefill rank the descriptors it
posted beside the count `transport.mapping` predicts for it from the instance's buffer tables.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOM = (7, 0)


@dataclass
class Prefilled:
    first: int  # prefill's greedy first token
    decode_first: int  # the same, read from decode's checked metadata row
    pools: dict[str, torch.Tensor]  # decode's pages of every pool, on the host
    forward_s: float  # the prompt's pipelined forward, to the first token on the host
    descs: list[int] = field(default_factory=list)  # per prefill rank (pp-major): descriptors posted
    predicted: list[int] = field(default_factory=list)  # the same, as the mapping predicts


def cluster(model: Path, draft: Path | None, pp: int, tp: int, pages: int, device: str, page_size: int,
            timeout_s: float) -> dict:
    """The raw config of prefill (pp × tp ranks; GPUs 0 .. pp·tp − 1) and decode (one rank; the
    last GPU) instances."""
    from glm53.support.ports import free_ports

    ports = free_ports(4)
    cuda = device == "cuda"
    last_gpu = torch.cuda.device_count() - 1 if cuda else 0
    # On a GPU that prefill also uses, both must state their share (the pages are fixed anyway).
    gpu = lambda ids: {"devices": ids, "mem_fraction_static": 0.45} if cuda else {}  # noqa: E731
    return {
        "model": {"path": str(model)},
        "transfer": {"bootstrap_timeout_s": timeout_s, "transfer_timeout_s": timeout_s},
        **({"speculative": {"algorithm": "DFLASH", "draft_model_path": str(draft)}} if draft else {}),
        "defaults": {"device": device, "dtype": "bfloat16" if cuda else "float32", "page_size": page_size,
                     "num_pages": pages, "disable_cuda_graph": True},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1], "pp": pp,
                     "tp": tp, **gpu(list(range(pp * tp))),
                     **({"dist_init_port": ports[3]} if pp * tp > 1 else {})}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2], **gpu([last_gpu])}],
    }


def decode_side(raw: dict, model: str, bootstrap: str, pages: list[int], out: str, q, timeout_s: float) -> None:
    """Decode's one rank: receive the room, save its pages of every pool and its buffer table."""
    from glm53.models import GlmConfig
    from glm53.server.config_parse import parse_config
    from glm53.server.engine.worker import RankWorker, rank_specs
    from glm53.transport import TERMINAL, KVPoll, Room, RoomTransfer

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    cfg = parse_config(raw)
    (spec,) = rank_specs(cfg, cfg.decode[0], model, GlmConfig.from_dir(model).num_hidden_layers)
    rank = RankWorker(spec)
    rank.allocate(raw["defaults"]["num_pages"])
    try:
        rx = RoomTransfer([rank.create_receiver(Room(*ROOM), bootstrap, pages)])
        q.put("ready")
        deadline = time.monotonic() + timeout_s
        while rx.poll() not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.005)
        if rx.poll() != KVPoll.SUCCESS:
            q.put(f"decode's receiver ended {rx.poll()}: {rx.error}")
            return
        torch.save({"first": rx.metadata().first_token_ids[0], "table": rank.transfer.table.to_wire(),
                    "pools": {name: pool.tensor[pages].cpu() for name, pool in rank.runner.pools}}, out)
        q.put("done")
    finally:
        rank.close()


def predicted_descs(bootstrap: str, decode_table, src: list[int], dst: list[int]) -> list[int]:
    """Per prefill rank (pp-major), the descriptors `mapping.plan_transfers` routes to decode's one
    rank for pages src -> dst sent as one chunk."""
    from glm53.transport.bootstrap import query_topology
    from glm53.transport.buffers import BufferTable
    from glm53.transport.mapping import count_descriptors, plan_transfers

    topo = query_topology(bootstrap)
    ranks = sorted(topo["ranks"], key=lambda r: (r["pp"], r["tp"]))
    stages = [BufferTable.from_wire(r["table"]) for r in ranks if r["tp"] == 0]
    plan = plan_transfers(stages, topo["tp_size"], BufferTable.from_wire(decode_table), 1)
    return [count_descriptors(plan.segments(r["pp"], r["tp"], 0), src, dst) for r in ranks]


def prefill_into_decode(model: Path, draft: Path | None, prompt: list[int], *, pp: int = 1, tp: int = 1,
                        device: str = "cpu", page_size: int = 16, chunk: int = 64, workdir: Path,
                        timeout_s: float = 120.0) -> Prefilled:
    """The prompt in `chunk`-token micro-batches, one pipelined step, its pages sent as one chunk
    after the forward, then the metadata row. Raises on any failure (nothing is left running)."""
    from glm53.models import GlmConfig, SeqChunk
    from glm53.server.config_parse import parse_config
    from glm53.server.engine.group import LocalWorkers
    from glm53.server.engine.processes import ProcessWorkers
    from glm53.server.engine.worker import rank_specs
    from glm53.transport import BootstrapServer, KVPoll, MetadataRow, Room

    n_pages = -(-len(prompt) // page_size)
    raw = cluster(model, draft, pp, tp, n_pages + 8, device, page_size, timeout_s)
    cfg = parse_config(raw)
    inst = cfg.prefill[0]
    boot = BootstrapServer("p0", pp_size=pp, tp_size=tp, host="127.0.0.1", port=inst.bootstrap_port)
    ranks = None
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    pages = list(range(3, 3 + n_pages))  # not from page 0: offsets must be right
    src = list(range(5, 5 + n_pages))  # prefill's pages: another offset, so a src/dst mix-up shows
    out = workdir / f"decode-pp{pp}-tp{tp}.pt"
    child = ctx.Process(target=decode_side, args=(raw, str(model), boot.address, pages, str(out), q, timeout_s))
    # A rank in this process computes with one intra-op thread, as every rank process does (and a
    # served CPU rank): results then do not depend on pp × tp, whatever the caller's thread count.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        specs = rank_specs(cfg, inst, str(model), GlmConfig.from_dir(model).num_hidden_layers)
        ranks = LocalWorkers(specs) if pp * tp == 1 else ProcessWorkers(specs, timeout_s=timeout_s,
                                                                        port=inst.engine.dist_init_port)
        child.start()
        if (msg := q.get(timeout=timeout_s)) != "ready":
            raise RuntimeError(msg)
        tx = ranks.create_senders(Room(*ROOM), "d0")
        mbs = [[SeqChunk(prompt[i : i + chunk], i, src)] for i in range(0, len(prompt), chunk)]
        t0 = time.perf_counter()
        logits = ranks.forward_microbatches(mbs)
        first = int(logits[-1][0][-1].argmax())
        forward_s = time.perf_counter() - t0
        tx.send_pages(src, start=0)
        sent = len(prompt) if draft else 0
        tx.finish(MetadataRow(first_token_ids=(first,), counts=(len(prompt), sent)))
        deadline = time.monotonic() + timeout_s
        while tx.poll() not in (KVPoll.SUCCESS, KVPoll.FAILED) and time.monotonic() < deadline:
            ranks.sync()
            time.sleep(0.005)
        if tx.poll() != KVPoll.SUCCESS:
            raise RuntimeError(f"prefill's senders ended {tx.poll()}")
        if (msg := q.get(timeout=timeout_s)) != "done":
            raise RuntimeError(msg)
        child.join(timeout_s)
        got = torch.load(out)
        return Prefilled(first, got["first"], got["pools"], forward_s,
                         descs=[h.stats.get("descs", 0) for h in tx.handles],
                         predicted=predicted_descs(boot.address, got["table"], src, pages))
    finally:
        torch.set_num_threads(threads)
        if child.is_alive():
            child.kill()
            child.join(10)
        if ranks is not None:
            ranks.close()
        boot.close()
