"""Pipeline-parallel prefill into a real decode rank, through real processes and UCX: a prompt is
prefilled by pp = 1, 2, 3, 4 stages (gloo rank processes, consecutive chunks pipelined as
micro-batches) and each stage writes its own layers' pages into one decode rank's pools. The
decode side must end up byte-identical to pp = 1 — target latent KV, indexer keys and, with
DFlash, the draft KV (whose context the stages project partially and the last stage finishes) —
and the first token the same. The embedded model's 6 layers with index sharing (full, full,
shared, full, shared, full) and draft features of layers 1 and 3 put a feature on the last layer
of a stage and a shared layer right after a boundary."""

from __future__ import annotations

import time

import pytest
import torch

from glm53.models import GlmConfig, SeqChunk, write_random_draft
from glm53.server.config import parse_config
from glm53.server.engine.group import LocalWorkers
from glm53.server.engine.processes import ProcessWorkers
from glm53.server.engine.worker import RankWorker, rank_specs
from glm53.transport import BootstrapServer, KVPoll, MetadataRow, Room, RoomTransfer
from tests.net import free_ports

CHUNK = 24
PAGES = 48


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, model_dir):
    return write_random_draft(tmp_path_factory.mktemp("draft"), model_dir, seed=4, n_layers=2, block_size=4)


def prefill_into_decode(model_dir, draft_dir, pp: int, prompt: list[int]) -> tuple[int, dict[str, torch.Tensor]]:
    ports = free_ports(5)
    cfg = parse_config({
        "model": {"path": str(model_dir)},
        "transfer": {"bootstrap_timeout_s": 30, "transfer_timeout_s": 30},
        **({"speculative": {"algorithm": "DFLASH", "draft_model_path": str(draft_dir)}} if draft_dir else {}),
        "defaults": {"device": "cpu", "dtype": "float32", "page_size": 16, "num_pages": PAGES},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1], "pp": pp,
                     **({"dist_init_port": ports[3]} if pp > 1 else {})}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2]}],
    })
    layers = GlmConfig.from_dir(model_dir).num_hidden_layers
    p_inst, d_inst = cfg.prefill[0], cfg.decode[0]
    boot = BootstrapServer("p0", pp_size=pp, tp_size=1, host="127.0.0.1", port=p_inst.bootstrap_port)
    specs = rank_specs(cfg, p_inst, str(model_dir), layers)
    prefill = LocalWorkers(specs) if pp == 1 else ProcessWorkers(specs, timeout_s=60, port=ports[3])
    (d_spec,) = rank_specs(cfg, d_inst, str(model_dir), layers)
    decode = RankWorker(d_spec)
    decode.allocate(PAGES)
    try:
        n_pages = -(-len(prompt) // 16)
        pages = list(range(3, 3 + n_pages))  # not starting at 0: offsets must be right
        room = Room(7, 0)
        rx = RoomTransfer([decode.create_receiver(room, boot.address, pages)])
        tx = prefill.create_senders(room, "d0")
        chunks = [prompt[i : i + CHUNK] for i in range(0, len(prompt), CHUNK)]
        mbs = [[SeqChunk(c, i * CHUNK, pages)] for i, c in enumerate(chunks)]  # one step, pipelined
        logits = prefill.forward_microbatches(mbs)
        first = int(logits[-1][0][-1].argmax())
        tx.send_pages(pages, start=0)
        sent = len(prompt) if draft_dir else 0
        tx.finish(MetadataRow(first_token_ids=(first,), counts=(len(prompt), sent)))
        deadline = time.monotonic() + 30
        while rx.poll() not in (KVPoll.SUCCESS, KVPoll.FAILED) and time.monotonic() < deadline:
            prefill.sync()
            time.sleep(0.01)
        assert rx.poll() == KVPoll.SUCCESS, rx.error
        while tx.poll() != KVPoll.SUCCESS and time.monotonic() < deadline:
            prefill.sync()
            time.sleep(0.01)
        assert rx.metadata().first_token_ids == (first,)
        return first, {name: pool.tensor[pages].clone() for name, pool in decode.runner.pools}
    finally:
        prefill.close()
        decode.close()
        boot.close()


def test_pp_stages_fill_decode_exactly_like_one_stage(model_dir, draft_dir):
    """With DFlash on: the target pools and the draft KV in one run (pp=2 in the e2e tests runs
    without the draft)."""
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(10, 4000, (150,), generator=g).tolist()  # > index_topk (64): sparse
    ref_first, ref = prefill_into_decode(model_dir, draft_dir, 1, prompt)
    assert set(ref) == {"latent", "index_k", "draft_kv"}
    assert all(bool(t.abs().sum() > 0) for t in ref.values())  # the reference really was written
    for pp in (2, 3, 4):
        first, got = prefill_into_decode(model_dir, draft_dir, pp, prompt)
        assert first == ref_first, pp
        assert set(got) == set(ref)
        for name in ref:
            assert torch.equal(got[name], ref[name]), (pp, name, float((got[name] - ref[name]).abs().max()))
