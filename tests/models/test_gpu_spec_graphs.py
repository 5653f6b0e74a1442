"""CUDA graphs of the DFlash step (models/spec_graph.py): replay against the same step run eagerly
and against the eager DFlash step, no host sync inside a step, and greedy DFlash decoding with
graphs equal to decoding without a draft and to the CPU reference. Skipped without a GPU."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
import torch

from glm53.models import DraftBlock, ModelRunner, PageAllocator, SeqChunk
from glm53.models.graph import GraphConfig, pick
from glm53.models.spec_graph import split_output, step_rows
from glm53.support.oracle import make_checkpoint
from tests.models.draft_oracle import make_draft_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs, Triton kernels)"),
]

PS, PAGES, K = 16, 96, 4


@pytest.fixture(scope="module", params=["DFLASH", "DSPARK"])
def ckpts(tmp_path_factory, request):
    """DSPARK: the draft with random Markov and confidence heads, cutting at 0.5, so blocks end
    early at random places: the same graphs must replay them (no recapture)."""
    root = tmp_path_factory.mktemp("spec_graphs")
    make_checkpoint(root / "target", seed=11, index_topk_freq=2, index_skip_topk_offset=2)
    heads = dict(markov_rank=8, confidence_head=True) if request.param == "DSPARK" else {}
    make_draft_checkpoint(root / "draft", root / "target", seed=12, target_layer_ids=[1, 2, 4], block_size=K, **heads)
    return root / "target", root / "draft", 0.5 if heads else 0.0


def _runner(ckpts, dtype, graphs):
    r = ModelRunner.from_dir(ckpts[0], page_size=PS, num_pages=1, device="cuda", dtype=dtype, progress=False,
                             draft_dir=ckpts[1], confidence_threshold=ckpts[2])
    return ModelRunner(r.model, num_pages=PAGES, page_size=PS, device="cuda", draft=r.draft, graphs=graphs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spec_graph_replay_equals_eager_and_syncs_nothing(ckpts, dtype):
    # max_context 400: one width of 25 pages; batch buckets 1, 2, 4, 6
    runner = _runner(ckpts, dtype, GraphConfig(max_bs=6, max_context=400, block=K))
    graphs = runner.spec_graphs
    assert runner.graphs is None and graphs.k == K and graphs.sizes == (1, 2, 4, 6) and len(graphs.graphs) == 4
    rng = random.Random(3)
    g = torch.Generator().manual_seed(1)
    alloc = PageAllocator(PAGES)
    reqs = []  # [pages, start (the last token's position), last token, ctx_start]
    cut = False
    for n in [17, 230, 64, 5, 131, 300]:  # several past index_topk (8): sparse attention
        pages = alloc.alloc(runner.pages_needed(n + 60))
        prompt = torch.randint(0, runner.cfg.vocab_size, (n,), generator=g).tolist()
        tok = int(runner.forward([SeqChunk(prompt, 0, pages)])[0][-1].argmax())
        reqs.append([pages, n, tok, n // 2])
    for step, n in enumerate((1, 3, 6, 5, 2, 4, 6)):  # padded sizes (3 -> 4, 5 -> 6), rows moving
        batch = reqs[:n] if step % 2 else reqs[-n:]
        blocks = [DraftBlock(tok, pos, pages, ctx_start=ctx, block_size=1 + (i + step) % K)
                  for i, (pages, pos, tok, ctx) in enumerate(batch)]
        hit = graphs.bucket(blocks)
        assert hit is not None
        rows, key = hit
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens, logits = graphs.launch(rows, key)  # state update + replay
            lg = logits[: n * K].clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        got = split_output(rows, K, tokens[:n].cpu().tolist(), lg)
        # the same step eagerly on the same state (rewrites the same KV): the same bits for the
        # requests' tokens (a row's padding tokens all write one slot of the padding page, in no
        # fixed order, so their own outputs are not compared)
        moved = graphs.state.rows.clone()  # the replay left its rows at the next step (advance)
        graphs.state.update(rows)  # back to the rows the replay ran on
        same_t, same_l = graphs.run_eager(*key)
        assert torch.equal(graphs.state.rows, moved)
        verified = tokens[:n, -1].tolist()  # each row's n, or fewer where the confidence cut ended it
        cut |= any(v < r.n for v, r in zip(verified, rows))
        real = torch.tensor([i * K + j for i, v in enumerate(verified) for j in range(v)], device="cuda")
        assert torch.equal(tokens[:n, : K - 1], same_t[:n, : K - 1]) and torch.equal(tokens[:n, -1], same_t[:n, -1])
        assert torch.equal(tokens[:n, K - 1 : 2 * K - 1].reshape(-1)[real],
                           same_t[:n, K - 1 : 2 * K - 1].reshape(-1)[real])
        assert torch.equal(lg[real], same_l[real]), float((lg[real] - same_l[real]).abs().max())
        # and the eager DFlash step (own widths, no padding, drafts through the host)
        runner.spec_graphs = None
        try:
            ref = runner.spec_step(blocks)
        finally:
            runner.spec_graphs = graphs
        first = torch.stack([x[0] for x in got.logits])  # row 0 does not depend on the drafts
        want = torch.stack([x[0] for x in ref.logits])
        rel = float((first - want).norm() / want.norm())
        assert rel <= (1e-5 if dtype == torch.float32 else 2e-2), rel
        if dtype == torch.float32:
            assert got.drafts == ref.drafts and got.greedy == ref.greedy
            for a, b in zip(got.logits, ref.logits):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        for r, am in zip(batch, ref.greedy):  # commit a random accepted prefix (of the verified, cut or not)
            a = rng.randrange(1, len(am) + 1)
            r[1] += a  # the committed d_1 .. d_{a-1} sit before the new last token, the target's
            r[2] = am[a - 1]
    assert graphs.replays == 7
    assert cut == (ckpts[2] > 0)  # cut blocks replayed the graphs captured at start-up


def test_greedy_dflash_with_graphs_equals_off_and_cpu():
    """The embedded trained pair (and its DSpark draft) through the decode scheduler's real loop
    (fp32, greedy; with graphs, overlapped)."""
    from glm53.server.embedded_model import ensure_embedded_draft, ensure_embedded_dspark, ensure_embedded_model
    from glm53.server.offline import greedy_generate
    from glm53.support.decode_loop import decode_run, scheduler

    root = Path(tempfile.mkdtemp(prefix="spec-graphs-"))
    model, draft = ensure_embedded_model(root), ensure_embedded_draft(root)
    dspark = ensure_embedded_dspark(root)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (90, 40, 170)]
    new = 40
    cpu = ModelRunner.from_dir(model, page_size=16, num_pages=256, progress=False)
    want = greedy_generate(cpu, PageAllocator(256), prompts, new, ignore_eos=True)
    for draft_dir, graphs in ((None, True), (draft, True), (draft, False), (dspark, True)):
        sched = scheduler(model, draft_dir, "cuda", 4, graphs=graphs, max_running=4)
        try:
            runner = sched.workers.rank.runner
            _, toks, verify, outs = decode_run(sched, prompts, new)
            assert outs == want, (draft_dir, graphs)
            if draft_dir is not None:
                assert toks / verify > 1.3  # the drafts were accepted: multi-token steps ran
                assert (runner.spec_graphs is not None and runner.spec_graphs.replays > 0) == graphs
                if graphs:  # the overlapped loop launched steps on the rows the device moved
                    assert runner.spec_graphs.chained > 0
            else:
                assert runner.graphs.replays > 0
            if graphs:  # the prompts' forwards (< 256 tokens) replayed prefill graphs
                assert runner.prefill_graphs.replays >= len(prompts)
        finally:
            sched.close()


def test_relaunch_equals_a_launch_from_the_host_rows_and_syncs_nothing(ckpts):
    """The overlapped loop's chain: a replay on the rows the last step moved on the device
    (`relaunch`) gives what a launch from the host's rows after greedy acceptance gives, with no
    host sync in the launch, the relaunches or the copies back."""
    from glm53.server.engine.overlap import InflightSpec

    runner = _runner(ckpts, torch.float32, GraphConfig(max_bs=4, max_context=400, block=K))
    g = torch.Generator().manual_seed(9)
    alloc = PageAllocator(PAGES)
    blocks = []
    for n, new in [(40, 30), (150, 3), (9, 12)]:  # 3 new: the second row reaches its end on the way
        pages = alloc.alloc(runner.pages_needed(n + new))
        prompt = torch.randint(0, runner.cfg.vocab_size, (n,), generator=g).tolist()
        tok = int(runner.forward([SeqChunk(prompt, 0, pages)])[0][-1].argmax())
        blocks.append(DraftBlock(tok, n, pages, ctx_start=n // 3, block_size=min(K, new - 1), end_pos=n + new))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = [InflightSpec.launch(blocks, runner.spec_launch(blocks), [b.start_pos for b in blocks])]
        for _ in range(3):
            steps.append(InflightSpec.launch(blocks, runner.spec_relaunch(len(blocks), 400), []))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    chained = [s.host.tolist() for s in steps]
    # The same chain from the host: each step launched from the rows greedy acceptance gives (a
    # row with nothing left to verify keeps its rows, as `SpecState.advance` keeps them).
    graphs = runner.spec_graphs
    wide = (pick(graphs.sizes, len(blocks)), pick(graphs.widths, -(-400 // PS)))  # the chain's graph
    host, ended = list(blocks), False
    for k, want in enumerate(chained):
        got = graphs.launch(step_rows(host, K), wide)[0][: len(host)].cpu().tolist()
        # what a row's step decides: its n drafts and argmaxes and its n (the argmaxes of its
        # padding tokens, past n, race on the padding page's slot)
        used = lambda t: (t[: t[-1] - 1], t[K - 1 : K - 1 + t[-1]], t[-1])  # noqa: E731
        assert [used(t) for t in got] == [used(t) for t in want], k
        nxt = []
        for b, acc in zip(host, InflightSpec(host, torch.tensor(got), None, []).result()):
            start = b.start_pos + len(acc)
            left = b.end_pos - start - 1
            ended |= left <= 0
            nxt.append(DraftBlock(acc[-1], start, b.page_table, ctx_start=b.ctx_start, block_size=min(K, left),
                                  end_pos=b.end_pos) if left > 0 else b)
        host = nxt
    assert ended
