"""The overlapped speculative loop (engine/overlap.py `InflightSpec`, models/spec_state.py
`advance`) against the synchronous one, through the decode scheduler's real loop on the CPU: the
embedded trained pair (so blocks accept several tokens), the graphs' step run eagerly on the
state (`SpecGraphs(capture=False)`; capture and replay: tests/models/test_gpu_spec_graphs.py).
Step k + 1 launches on the rows step k's graph moved on the device before the host reads step k,
so a wrong advance (last token, start, n near max_new_tokens) changes every later token. Checked:
outputs and accept counts equal to the synchronous loop's and the outputs to decoding without a
draft, for a batch with different lengths, a join, a stop token, an abort; DSpark with its
confidence cut; nothing committed past a stop; an in-flight row's pages never freed; all pages
back; most steps launched from the device's rows."""

from __future__ import annotations

import pytest
import torch

from glm53.models import ModelRunner, PageAllocator, SeqChunk
from glm53.models.graph import GraphConfig
from glm53.models.spec_graph import SpecGraphs
from glm53.server.embedded_model import ensure_embedded_draft, ensure_embedded_dspark, ensure_embedded_model
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.engine.decode_request import DecodeRequest
from glm53.server.offline import greedy_generate
from glm53.server.protocol import Abort, GenerateRequest, PeerInfo, RequestSpec
from glm53.server.sampling import SamplingParams
from glm53.support.decode_loop import scheduler

K = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("overlap_spec")
    return ensure_embedded_model(root), ensure_embedded_draft(root), ensure_embedded_dspark(root)


def _scheduler(model, draft, overlap: bool, threshold: float = 0.0) -> tuple[DecodeScheduler, list, list[int]]:
    sched = scheduler(model, draft, "cpu", K, graphs=False, max_running=8, threshold=threshold)
    runner = sched.workers.rank.runner
    pad = sched.allocator.alloc(1)  # the page padded rows write: never a request's
    runner.spec_graphs = SpecGraphs(runner, GraphConfig(max_bs=8, max_context=512, block=K), pad_page=pad[0],
                                    capture=False)
    sched.spec_overlap = overlap
    sent = []
    sched.channel.send = lambda _to, ev: sent.append(ev)
    return sched, sent, pad


def _adopt(sched: DecodeScheduler, room: int, prompt: list[int], max_new: int, stop=()) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=list(stop))
    req = GenerateRequest(spec=RequestSpec(f"r{room}", prompt, params, []), room=room, generation=0,
                          prefill=PeerInfo("p0", "prefill", "h", 1, 2), decode=PeerInfo("d0", "decode", "h", 3, None),
                          reply_to="tcp://unused:1")
    r = DecodeRequest(req, arrived=0.0, pages=sched.allocator.alloc(sched.workers.pages_needed(len(prompt) + max_new)))
    first = int(sched.workers.forward([SeqChunk(prompt, 0, r.pages)])[0][-1].argmax())  # writes the draft context
    sched._commit(r, [first], first=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (60, 25, 90, 40)]


def _run(model, draft, overlap: bool, stop: int | None = None, abort: bool = False, threshold: float = 0.0):
    """Three requests, a fourth joining at step 3 (with `stop`), optionally an abort of the
    first at step 4; decoded to the end. (outputs, accept counts, finish reasons, (launches from
    the device's rows, all launches))."""
    prompts, news = _prompts(), (30, 17, 9, 26)
    sched, sent, pad = _scheduler(model, draft, overlap, threshold)
    graphs = sched.workers.rank.runner.spec_graphs
    try:
        for room in range(3):
            _adopt(sched, room, prompts[room], news[room])
        steps = 0
        while sched.running or sched.inflight is not None:
            if steps == 3:
                _adopt(sched, 3, prompts[3], news[3], stop=() if stop is None else (stop,))
            if steps == 4 and abort:
                sched.on_abort(Abort(room=0, generation=0, reason="client gone"))
            sched._decode()
            if sched.inflight is not None:  # the rows a launched step writes keep their pages
                for r in sched.inflight.batch:
                    assert r.pages and all(sched.allocator._used[p] for p in r.pages)
            steps += 1
            assert steps < 200
        sched.allocator.free(pad)
        assert sched.allocator.num_free == sched.allocator.num_pages
        outs: dict[int, list[int]] = {}
        accepts: dict[int, list[int]] = {}
        for ev in sent:
            outs.setdefault(ev.room, []).extend(ev.token_ids)
            accepts.setdefault(ev.room, []).extend(ev.spec_accept)
        reasons = {ev.room: ev.finish_reason for ev in sent if ev.finish_reason}
        return outs, accepts, reasons, (graphs.chained, graphs.replays)
    finally:
        sched.close()


@pytest.mark.parametrize("drafted", ["dflash", "dspark-cut"])
def test_overlapped_speculation_equals_synchronous(pair, drafted):
    model, dflash, dspark = pair
    draft, threshold = (dflash, 0.0) if drafted == "dflash" else (dspark, 0.3)
    outs, accepts, reasons, chained = _run(model, draft, overlap=False, threshold=threshold)
    assert chained[0] == 0 and chained[1] > 0
    # Decoding without a draft gives the same tokens.
    cpu = ModelRunner.from_dir(model, page_size=16, num_pages=128, progress=False)
    prompts = _prompts()
    for room, new in zip(range(4), (30, 17, 9, 26)):
        want = greedy_generate(cpu, PageAllocator(128), [prompts[room]], new, ignore_eos=True)[0]
        assert outs[room] == want, room
    assert max(a for v in accepts.values() for a in v) > 1  # multi-token steps ran

    stop = outs[3][6]
    first = outs[3].index(stop)
    sync = _run(model, draft, overlap=False, stop=stop, threshold=threshold)
    over = _run(model, draft, overlap=True, stop=stop, threshold=threshold)
    assert over[:3] == sync[:3]
    assert sync[0][3] == outs[3][: first + 1] and sync[2][3] == "stop"  # nothing past the stop
    assert over[3][0] >= over[3][1] // 2, over[3]  # most steps launched from the device's rows

    # An abort while a step holds the row: its pages wait for that step, the others go on.
    sync = _run(model, draft, overlap=False, abort=True, threshold=threshold)
    over = _run(model, draft, overlap=True, abort=True, threshold=threshold)
    assert over[:2] == sync[:2] and over[2] == sync[2]
    assert len(over[0][0]) < 30 and 0 not in over[2]
