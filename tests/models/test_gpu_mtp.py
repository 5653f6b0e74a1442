"""The MTP (NextN) draft on a GPU: its rows on CUDA (Triton MLA, indexer and MoE kernels over the
mtp pools) against the CPU; greedy decoding with the draft equal to plain decoding on the same
device, fp32 and bf16, eagerly and from the CUDA graphs of its step (models/mtp_graph.py); the
graph replay against the same step run eagerly and against the eager step, syncing nothing.
Skipped without a GPU."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
import torch

from glm53.models import DraftBlock, GlmConfig, ModelRunner, PageAllocator, SeqChunk
from glm53.models.draft import DraftSampling
from glm53.models.graph import GraphConfig
from glm53.support.greedy import spec_greedy
from glm53.support.mtp_checkpoint import random_nextn, write_mtp_layer
from glm53.support.oracle import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)"),
]

PS, PAGES = 16, 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_mtp") / "target"
    make_checkpoint(d, seed=21, index_topk_freq=2, index_skip_topk_offset=2)
    write_mtp_layer(d, random_nextn(GlmConfig.from_dir(d), seed=22))
    return d


def _runner(d, device, dtype=torch.float32, steps=3):
    return ModelRunner.from_dir(d, page_size=PS, num_pages=PAGES, device=device, dtype=dtype, progress=False,
                                nextn_steps=steps)


def test_rows_match_cpu(ckpt):
    g = torch.Generator().manual_seed(3)
    cfg = GlmConfig.from_dir(ckpt)
    toks = torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()  # 40 > index_topk: sparse
    hidden = torch.randn(40, cfg.hidden_size, generator=g)
    out = {}
    for dev in ("cpu", "cuda"):
        r = _runner(ckpt, dev)
        batch, _ = r.build_batch([SeqChunk(toks, 0, [5, 9, 2])])
        out[dev] = r.mtp.rows(batch.input_ids, hidden.to(dev), batch).cpu()
    torch.testing.assert_close(out["cuda"], out["cpu"], rtol=2e-3, atol=2e-3)


def _graph_runner(d, dtype, graphs: GraphConfig, steps=3, pages=PAGES) -> ModelRunner:
    r = ModelRunner.from_dir(d, page_size=PS, num_pages=1, device="cuda", dtype=dtype, progress=False,
                             nextn_steps=steps)
    return ModelRunner(r.model, num_pages=pages, page_size=PS, device="cuda", mtp=r.mtp, graphs=graphs)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_plain_on_cuda(ckpt, dtype, graphs):
    prompts, n = [[7, 3, 99, 41, 8] * 9, [120, 5, 66]], 20
    plain = ModelRunner.from_dir(ckpt, page_size=PS, num_pages=PAGES, device="cuda", dtype=dtype, progress=False)
    if graphs:
        r = _graph_runner(ckpt, dtype, GraphConfig(max_bs=4, max_context=400))
    else:
        r = _runner(ckpt, "cuda", dtype)
    pages = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    want = []
    for p, pg in zip(prompts, pages):
        out = [int(plain.forward([SeqChunk(p, 0, pg)])[0][-1].argmax())]
        while len(out) < n:
            out.append(int(plain.forward([SeqChunk([out[-1]], len(p) + len(out) - 1, pg)])[0][-1].argmax()))
        want.append(out)
    outs, _, _ = spec_greedy(r, prompts, pages, n, width=4)
    assert outs == want
    assert (r.mtp_graphs is not None and r.mtp_graphs.replays > 0) == graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mtp_graph_replay_equals_eager_and_syncs_nothing(ckpt, dtype):
    """Steps over requests seeded from prefill's hidden row, sampled or not, accepting random
    counts, batches padded (3 -> 4, 5 -> 6) with rows moving: the replay (state load included)
    syncs nothing and gives the same step run eagerly on the same state bit for bit, and the
    eager `_mtp_step` (its own shapes, no padding; fp32: the same drafts and argmaxes)."""
    # max_context 400: one width of 25 pages; batch buckets 1, 2, 4, 6; greedy and sampled graphs
    runner = _graph_runner(ckpt, dtype, GraphConfig(max_bs=6, max_context=400), pages=96)
    graphs, mtp = runner.mtp_graphs, runner.mtp
    assert runner.graphs is None and runner.spec_graphs is None
    assert graphs.k == 4 and graphs.sizes == (1, 2, 4, 6) and len(graphs.graphs) == 8
    state, k = graphs.state, graphs.k
    rng = random.Random(3)
    g = torch.Generator().manual_seed(1)
    alloc = PageAllocator(96)
    reqs = []  # [key, pages, start (the last token's position), last token, seed row]
    for key, n in enumerate([17, 230, 64, 5, 131, 300]):  # several past index_topk (8): sparse attention
        pages = alloc.alloc(runner.pages_needed(n + 60))
        prompt = torch.randint(0, runner.cfg.vocab_size, (n,), generator=g).tolist()
        lg = runner.forward([SeqChunk(prompt, 0, pages)])
        reqs.append([key, pages, n, int(lg[0][-1].argmax()), lg.last_hidden[0]])
    sampled_steps = 0
    for step, n in enumerate((1, 3, 6, 5, 2, 4, 6, 6)):  # padded sizes (3 -> 4, 5 -> 6), rows moving
        batch = reqs[:n] if step % 2 else reqs[-n:]
        blocks = []
        for i, r in enumerate(batch):
            samp = DraftSampling(0.8, 0, 1.0, 0.0, seed=step * 10 + i) if (r[0] + step) % 3 == 0 else None
            blocks.append(DraftBlock(r[3], r[2], r[1], block_size=1 + (i + step) % k if step else k, key=r[0],
                                     sampling=samp, seed_hidden=r[4]))
            r[4] = None  # the seed rides a request's first step only
        before = dict(mtp.state)
        ref = runner._mtp_step(blocks)  # eager first: it reads the slots the replay overwrites
        mtp.state = before
        hit = graphs.bucket(blocks)
        assert hit is not None
        rows, ups, key = hit
        sampled_steps += key[2]
        saved = state.hidden.clone()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rows, (tokens, logits, q) = graphs.launch(blocks, rows, ups, key)
            tokens, logits = tokens.clone(), logits.clone()
            q = q.clone() if q is not None else None
        finally:
            torch.cuda.set_sync_debug_mode(0)
        # the same step eagerly on the same state (the slots as the load left them): the same
        # bits for the requests' real rows (padding rows share the padding slot and page)
        state.hidden.copy_(saved)
        graphs.steps.load(blocks, rows, ups)
        same_t, same_l, same_q = graphs.run_eager(*key)
        got = graphs.steps.finish(blocks, rows, (tokens, logits, q))
        for i, r in enumerate(rows):
            m = r.n
            assert tokens[i, -1] == m == same_t[i, -1]
            assert torch.equal(tokens[i, : m - 1], same_t[i, : m - 1])
            assert torch.equal(tokens[i, k - 1 : k - 1 + m], same_t[i, k - 1 : k - 1 + m])
            assert torch.equal(logits[i * k : i * k + m], same_l[i * k : i * k + m])
            if r.sampling is not None and m > 1:
                assert torch.equal(q[i, : m - 1], same_q[i, : m - 1])
        # and the eager MTP step
        first = torch.stack([x[0] for x in got.logits])  # verify row 0 does not depend on the drafts
        want = torch.stack([x[0] for x in ref.logits])
        rel = float((first - want).norm() / want.norm())
        assert rel <= (1e-5 if dtype == torch.float32 else 2e-2), rel
        if dtype == torch.float32:
            assert got.drafts == ref.drafts and got.greedy == ref.greedy
            for a, b in zip(got.logits, ref.logits):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        for r, d, am in zip(batch, got.drafts, got.greedy):  # commit a random accepted prefix
            a = rng.randrange(1, len(d) + 2)
            r[2] += a
            r[3] = am[a - 1]
    assert graphs.replays == 8 and sampled_steps > 0
    # what the graphs do not hold runs eagerly: more requests than the largest bucket, a masked batch
    blocks = [DraftBlock(r[3], r[2], r[1], key=r[0]) for r in reqs]
    assert graphs.bucket(blocks + [DraftBlock(reqs[0][3], reqs[0][2], reqs[0][1])]) is None  # 7 > 6 (no key twice)
    assert graphs.bucket([DraftBlock(r[3], r[2], r[1], ctx_start=1, key=r[0]) for r in reqs]) is None
    assert graphs.bucket(blocks) is not None


def _nextn_scheduler(model: Path, graphs: bool):
    """A decode scheduler with NEXTN on one in-process CUDA rank (no prefill instance started)."""
    from glm53.server.config_parse import parse_config
    from glm53.server.engine.decode import DecodeScheduler
    from glm53.support.ports import free_ports

    ports = free_ports(4)
    raw = {"model": {"path": str(model)},
           "defaults": {"device": "cuda", "dtype": "float32", "page_size": 16, "num_pages": 2048,
                        "stream_interval": 1000, "max_running_requests": 4, "disable_cuda_graph": not graphs},
           # the prefill instance is never started; the config wants distinct GPUs
           "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1],
                        "devices": [1]}],
           "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2], "devices": [0]}],
           "speculative": {"algorithm": "NEXTN", "num_steps": 3}}
    cfg = parse_config(raw)
    return DecodeScheduler(cfg, cfg.decode[0])


def test_nextn_decode_loop_with_graphs_equals_off_and_cpu():
    """The embedded target and its trained MTP layer through the decode scheduler's real loop
    (fp32, greedy): the worker captures the MTP step graphs at start-up and the loop replays
    them; the output equals the CPU's plain greedy decoding, with graphs and without."""
    from glm53.server.embedded_model import ensure_embedded_model
    from glm53.server.offline import greedy_generate
    from glm53.support.decode_loop import decode_run

    model = ensure_embedded_model(Path(tempfile.mkdtemp(prefix="mtp-graphs-")))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (90, 40, 170)]
    new = 40
    cpu = ModelRunner.from_dir(model, page_size=16, num_pages=256, progress=False)
    want = greedy_generate(cpu, PageAllocator(256), prompts, new, ignore_eos=True)
    for graphs in (True, False):
        sched = _nextn_scheduler(model, graphs)
        try:
            runner = sched.workers.rank.runner
            assert (runner.mtp_graphs is not None) == graphs
            _, toks, verify, outs = decode_run(sched, prompts, new)
            assert outs == want, graphs
            assert toks / verify > 1.3  # the drafts were accepted (on the CPU: 117 tokens in 56 verifies)
            if graphs:
                assert runner.mtp_graphs.replays > 0
        finally:
            sched.close()
