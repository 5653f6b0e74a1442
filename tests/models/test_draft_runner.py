"""The draft inside `ModelRunner`: every chunk forward writes the draft context KV (chunked
prefill equals one shot and the reference over the target's own features; a verify forward writes
its B positions), a two-stage pipeline hands the partial projection on and ends with the same
draft KV, and tp=2 ranks (gloo) propose what tp=1 does while each holds its heads of tp=1's pool,
so the transfer layer's head mapping moves draft KV between tp=1 and tp=2 instances."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glm53.kernels.dispatch import cpu_multiplies_bf16
from glm53.models import DRAFT_KV, DraftBlock, DraftProjection, ModelRunner, PageAllocator, SeqChunk, StageInput
from glm53.support.oracle import make_checkpoint
from glm53.transport.buffers import BufferSpec, BufferTable
from glm53.transport.mapping import plan_transfers
from tests.models.draft_oracle import make_draft_checkpoint
from tests.models.tp_harness import greedy_from_rank0, run_ranks

SCHEDULE = dict(index_topk_freq=2, index_skip_topk_offset=2)  # F F S F S
IDS = [1, 2, 4]
PAGE, PAGES = 4, 64
B = 4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_runner")
    make_checkpoint(root / "target", seed=51, **SCHEDULE)
    ref = make_draft_checkpoint(root / "draft", root / "target", seed=52, target_layer_ids=IDS)
    return root / "target", root / "draft", ref


def runner(ckpts, **kw) -> ModelRunner:
    return ModelRunner.from_dir(ckpts[0], page_size=PAGE, num_pages=PAGES, progress=False, draft_dir=ckpts[1], **kw)


def prompts_and_pages(lengths, extra=B):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in lengths]
    alloc = PageAllocator(PAGES)
    held = [alloc.alloc(1) for _ in range(24)]
    for h in held[::2]:
        alloc.free(h)  # scattered pages
    return prompts, [alloc.alloc(-(-(n + extra) // PAGE)) for n in lengths]


def prefill(r: ModelRunner, prompts, pages, chunk: int) -> list[torch.Tensor]:
    """Chunked prefill of every prompt in one batch per step; each prompt's last-row logits."""
    last = {}
    for s in range(0, max(map(len, prompts)), chunk):
        live = [i for i, p in enumerate(prompts) if s < len(p)]
        out = r.forward([SeqChunk(prompts[i][s : s + chunk], s, pages[i]) for i in live])
        last.update({i: o[-1] for i, o in zip(live, out)})
    return [last[i] for i in range(len(prompts))]


def draft_kv_at(r: ModelRunner, pages, n) -> torch.Tensor:
    """[n, heads, layers, head_dim] of one request's first n positions."""
    t = r.pools[DRAFT_KV].tensor
    return torch.stack([t[pages[p // PAGE], :, :, p % PAGE] for p in range(n)])


def test_chunked_prefill_writes_the_one_shot_draft_kv(ckpts):
    # fp32 products: rounding the context rows to bf16 (`cpu_bf16`) turns their last-bit
    # differences between chunkings into bf16 ones (tests/models/test_draft_cpu_path.py checks it)
    prompts, pages = prompts_and_pages([19, 11])
    chunked, whole = runner(ckpts, draft_cpu_bf16=False), runner(ckpts, draft_cpu_bf16=False)
    last_c = prefill(chunked, prompts, pages, chunk=5)
    last_w = prefill(whole, prompts, pages, chunk=64)
    for p, pg in zip(prompts, pages):
        torch.testing.assert_close(draft_kv_at(chunked, pg, len(p)), draft_kv_at(whole, pg, len(p)), rtol=1e-5, atol=1e-5)

    # The runner feeds the draft the target's own features: against the reference over captures
    # of a runner without a draft (layer 4, the last, is captured after the final norm).
    ref = ckpts[2]
    plain = ModelRunner.from_dir(ckpts[0], page_size=PAGE, num_pages=PAGES, progress=False)
    assert plain.draft is None and DRAFT_KV not in plain.pools
    for p, pg in zip(prompts, pages):
        caps = plain.forward_stage([SeqChunk(p, 0, pg)], capture=IDS).captures
        kv = ref.context_kv(ref.context(caps), torch.arange(len(p)))
        got = draft_kv_at(whole, pg, len(p))
        for layer, (k, v) in enumerate(kv):
            torch.testing.assert_close(got[:, 0::2, layer], k, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got[:, 1::2, layer], v, rtol=1e-4, atol=1e-4)

    # A verify forward writes draft KV for all B positions; once committed they are what a
    # one-shot prefill of the longer sequence writes, and drafting from there agrees.
    first = [int(lg.argmax()) for lg in last_c]
    assert first == [int(lg.argmax()) for lg in last_w]
    blocks = [DraftBlock(t, len(p), pg) for t, p, pg in zip(first, prompts, pages)]
    props = chunked.propose(blocks)
    assert torch.equal(props, whole.propose(blocks))
    verify = [SeqChunk([t] + pr.tolist(), len(p), pg, all_logits=True) for t, pr, p, pg in zip(first, props, prompts, pages)]
    chunked.forward(verify)
    longer = [p + c.token_ids for p, c in zip(prompts, verify)]
    again = runner(ckpts, draft_cpu_bf16=False)
    prefill(again, longer, pages, chunk=64)
    for p, pg in zip(longer, pages):
        torch.testing.assert_close(draft_kv_at(chunked, pg, len(p)), draft_kv_at(again, pg, len(p)), rtol=1e-5, atol=1e-5)
    nxt = [DraftBlock(c.token_ids[2], len(p) + 2, pg) for c, p, pg in zip(verify, prompts, pages)]
    assert torch.equal(chunked.propose(nxt), again.propose(nxt))


def test_two_stage_pipeline_writes_the_one_stage_draft_kv(ckpts):
    first = runner(ckpts, layers=range(0, 2))
    last = runner(ckpts, layers=range(2, 5))
    whole = runner(ckpts)
    assert isinstance(first.projection, DraftProjection) and first.projection.ids == (1,) and first.draft is None
    assert DRAFT_KV not in first.pools and DRAFT_KV in last.pools and last.draft_ids == (2, 4)
    prompts, pages = prompts_and_pages([17, 10])
    for s in range(0, 17, 6):
        live = [i for i, p in enumerate(prompts) if s < len(p)]
        chunks = [SeqChunk(prompts[i][s : s + 6], s, pages[i], all_logits=True) for i in live]
        out = first.forward_stage(chunks)
        assert out.draft_acc is not None and out.draft_acc.dtype == torch.float32 and out.captures == {}
        got = last.forward(chunks, out.next_input())
        want = whole.forward(chunks)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for p, pg in zip(prompts, pages):
        torch.testing.assert_close(draft_kv_at(last, pg, len(p)), draft_kv_at(whole, pg, len(p)), rtol=1e-5, atol=1e-5)
    # The last stage refuses to write draft KV without the upstream partial sum.
    chunks = [SeqChunk(prompts[0][:4], 0, pages[0])]
    out = first.forward_stage(chunks)
    with pytest.raises(ValueError, match=r"draft feature layers \[1\] belong to earlier stages"):
        last.forward_stage(chunks, StageInput(out.hidden, out.topk_slots, None))
    with pytest.raises(ValueError, match="runs on the last stage only"):
        ModelRunner(first.model, PAGES, PAGE, draft=whole.draft)
    with pytest.raises(ValueError, match="draft projection is for non-last stages"):
        ModelRunner(whole.model, PAGES, PAGE, draft_projection=first.projection)


def scenario(r: ModelRunner, pick) -> dict:
    """Chunked prefill of three prompts, a draft, a verify forward of the block, a second draft."""
    prompts, pages = prompts_and_pages([13, 22, 9], extra=2 * B)
    first = pick(prefill(r, prompts, pages, chunk=8))
    blocks = [DraftBlock(t, len(p), pg) for t, p, pg in zip(first, prompts, pages)]
    props, logits = r.propose(blocks, return_logits=True)
    verify = [SeqChunk([t] + pr.tolist(), len(p), pg, all_logits=True) for t, pr, p, pg in zip(first, props, prompts, pages)]
    out = r.forward(verify)
    bonus = pick([o[0] for o in out])  # commit the block's first token and the target's next
    nxt = [DraftBlock(t, len(p) + 1, pg, ctx_start=2) for t, p, pg in zip(bonus, prompts, pages)]
    props2, logits2 = r.propose(nxt, return_logits=True)
    return {"props": [props, props2], "logits": [logits, logits2], "draft_kv": r.pools[DRAFT_KV].tensor.clone()}


def _rank_main(tp, target_dir: str, draft_dir: str, out: str) -> None:
    r = ModelRunner.from_dir(target_dir, page_size=PAGE, num_pages=PAGES, progress=False, tp=tp, draft_dir=draft_dir)
    assert r.draft.kv_heads_local == 1
    p = r.pools[DRAFT_KV]
    spec = BufferSpec.for_tensor(DRAFT_KV, p.tensor, layers=p.layers, total_heads=p.total_heads)
    spec.shard.check_tp(tp.size)
    res = scenario(r, greedy_from_rank0(tp))
    torch.save({**res, "head_range": spec.shard.head_range(tp.size, tp.rank)}, Path(out) / f"rank{tp.rank}.pt")


def test_tp2_proposals_and_draft_kv_shards_match_tp1(ckpts, tmp_path):
    # tp = 1 in fp32 products, as every tp > 1 drafts (`from_dir`'s bf16 rule skips TP)
    ref = scenario(runner(ckpts, draft_cpu_bf16=False), lambda rows: [int(x.argmax()) for x in rows])
    run_ranks(2, _rank_main, str(ckpts[0]), str(ckpts[1]), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["head_range"] for r in ranks] == [(0, 2), (2, 4)]
    for r in ranks:
        for a, b in zip(r["props"], ref["props"]):
            assert torch.equal(a, b)
        for a, b in zip(r["logits"], ranks[0]["logits"]):
            assert torch.equal(a, b)  # every rank returns the same logits, bit for bit
        for a, b in zip(r["logits"], ref["logits"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        lo, hi = r["head_range"]
        torch.testing.assert_close(r["draft_kv"], ref["draft_kv"][:, lo:hi], rtol=1e-5, atol=1e-5)

    # The transfer layer's plan moves every page of draft KV between tp=1 and tp=2 instances.
    tp1, tp2 = [ref["draft_kv"]], [r["draft_kv"] for r in ranks]
    for src, dst in ((tp1, tp2), (tp2, tp1)):
        moved = transfer_pages(src, dst)
        for got, want in zip(moved, dst):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def transfer_pages(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Applies `plan_transfers` for the draft_kv buffer from one instance's rank pools (`srcs`,
    tp = len) to zeroed pools shaped like `dsts`, every page id to the same page id."""
    def table(t: torch.Tensor) -> BufferTable:
        return BufferTable.of(BufferSpec.for_tensor(DRAFT_KV, t, layers=(0, 1), total_heads=4))

    plan = plan_transfers([table(srcs[0])], len(srcs), table(dsts[0]), len(dsts))
    outs = [torch.zeros_like(t) for t in dsts]
    as_bytes = lambda t: t.view(torch.uint8).view(t.shape[0], -1)  # noqa: E731 [pages, item bytes]
    for (_, s, d), segs in plan.routes.items():
        for seg in segs:
            src = as_bytes(srcs[s])[:, seg.src_off : seg.src_off + seg.length]
            as_bytes(outs[d])[:, seg.dst_off : seg.dst_off + seg.length] = src
    return outs


def test_bf16_drafting_keeps_greedy_output(ckpts):
    """The CPU drafting path in bf16 products (`DFlashDraft.cpu_bf16`; `from_dir` turns it on by
    itself where the CPU multiplies bf16 natively) proposes other tokens now and then; the output
    of speculative greedy decoding still equals plain greedy decoding."""
    assert runner(ckpts).draft.cpu_bf16 == cpu_multiplies_bf16()
    r = runner(ckpts, draft_cpu_bf16=True)
    assert r.draft.cpu_bf16
    prompts, pages = prompts_and_pages([19, 11], extra=40)
    plain_pages = prompts_and_pages([19, 11], extra=40)[1]
    new = 24
    for p, pg, ppg in zip(prompts, pages, plain_pages):
        plain = [int(r.forward([SeqChunk(p, 0, ppg)])[0][-1].argmax())]
        while len(plain) < new:
            plain.append(int(r.forward([SeqChunk(plain[-1:], len(p) + len(plain) - 1, ppg)])[0][-1].argmax()))
        out = [int(r.forward([SeqChunk(p, 0, pg)])[0][-1].argmax())]
        while len(out) < new:
            res = r.spec_step([DraftBlock(out[-1], len(p) + len(out) - 1, pg, block_size=min(B, new - len(out) + 1))])
            d, am = res.drafts[0], res.greedy[0]
            a = 0
            while a < len(d) and d[a] == am[a]:
                a += 1
            out += d[:a] + [am[a]]
        assert out[:new] == plain
