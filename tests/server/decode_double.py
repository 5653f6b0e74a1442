"""A worker double for the decode scheduler whose greedy token is a known function of the step's
input token and position (`next_token`): a step fed the wrong device-side input, or at the wrong
position, changes everything after it. Its steps assert they never write a free page. `scheduler`
builds a `DecodeScheduler` over it (events collected, nothing sent); `adopt` hands it a request as
if its KV had arrived; `reference_tokens` is what greedy decoding of the double gives. Used by
test_overlap_decode.py, test_decode_choices.py and test_transfer_bytes.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from glm53.server.config_parse import parse_config
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.engine.decode_request import DecodeRequest
from glm53.server.engine.group import WorkerGroup
from glm53.server.protocol import GenerateRequest, PeerInfo, RequestSpec
from glm53.support.ports import free_ports

V = 64


def next_token(pos: int, tok: int) -> int:
    """The double's greedy token after input `tok` at position `pos`."""
    return 10 + (tok * 7 + pos * 3) % 47


class Workers(WorkerGroup):
    device_tokens = True

    def __init__(self):
        self.cfg = type("Cfg", (), {"vocab_size": V, "max_position_embeddings": 4096})()
        self.num_pages, self.page_size, self.bytes_per_page = 64, 16, 1
        self.draft_bytes_per_page = 0
        self.block_size, self.sends_draft_kv = None, False
        self.steps: list[list[tuple[int, int, tuple[int, ...]]]] = []  # per step: (pos, input, pages)
        self.sched: DecodeScheduler | None = None
        self.routed = 0  # inputs taken from the device-side tokens

    def _rows(self, chunks, ids):
        free = self.sched.allocator._used
        step = []
        for c, t in zip(chunks, ids):
            assert all(free[p] for p in c.page_table), "a step writes pages that are free"
            step.append((c.start_pos, t, tuple(c.page_table)))
        self.steps.append(step)
        rows = []
        for c, t in zip(chunks, ids):
            row = torch.full((1, V), -5.0)
            row[0, next_token(c.start_pos, t)] = 5.0
            rows.append(row)
        return rows

    def forward_microbatches(self, microbatches):
        return [self._rows(chunks, [c.token_ids[-1] for c in chunks]) for chunks in microbatches]

    def forward_decode(self, chunks, tokens):
        ids = [c.token_ids[0] for c in chunks]
        if tokens is not None:
            for s, d in zip(tokens.src, tokens.dst):
                ids[d] = int(tokens.values[s])
                self.routed += 1
        return torch.cat(self._rows(chunks, ids))

    def spec_step(self, blocks):
        raise AssertionError("no draft here")

    def create_senders(self, room, decode_instance):
        raise AssertionError("no transfers in these tests")

    def create_receivers(self, room, bootstrap_address, dst_pages):
        raise AssertionError("no transfers in these tests")

    def copy_pages(self, src, dst):
        raise AssertionError("one choice per request here")

    def close(self):
        pass


def scheduler(overlap: bool) -> tuple[DecodeScheduler, list]:
    ports = free_ports(4)
    cfg = parse_config({
        "model": {"path": "/unused"},
        "defaults": {"device": "cpu", "page_size": 16, "num_pages": 64, "disable_overlap_schedule": not overlap},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2]}],
    })
    workers = Workers()
    sched = DecodeScheduler(cfg, cfg.decode[0], workers=workers)
    workers.sched = sched
    assert sched.overlap == overlap
    sent = []
    sched.channel.send = lambda _to, ev: sent.append(ev)
    return sched, sent


def adopt(sched: DecodeScheduler, spec: RequestSpec, room: int, counts: list[int]) -> DecodeRequest:
    """`spec` adopted by `sched` as if prefill's KV and commit record (`counts`, the double's
    first token for every choice) had arrived; returns the request (its first choice)."""
    req = GenerateRequest(spec=spec, room=room, generation=0, prefill=PeerInfo("p0", "prefill", "h", 1, 2),
                          decode=PeerInfo("d0", "decode", "h", 3, None), reply_to="tcp://unused:1")
    r = DecodeRequest(req, arrived=0.0, pages=sched.allocator.alloc(sched._request_pages(req)))
    n_prompt = len(spec.input_ids)
    first = next_token(n_prompt - 1, spec.input_ids[-1])
    row = SimpleNamespace(counts=list(counts), first_token_ids=[first] * spec.n, payload=b"")
    r.receiver = SimpleNamespace(metadata=lambda: row)
    sched._adopt(r)
    return r


def reference_tokens(prompt_len: int, n: int) -> list[int]:
    """What greedy decoding of the double gives: the first token, then each from the last."""
    toks = [next_token(prompt_len - 1, 3 + prompt_len - 1)]
    while len(toks) < n:
        toks.append(next_token(prompt_len + len(toks) - 1, toks[-1]))
    return toks
