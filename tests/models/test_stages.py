"""Pipeline stages in one process: each stage its own model (layers [a, b)) loaded from one
checkpoint with its own pools over the same page ids, chained by handing StageOutput on as
StageInput. Schedules put shared layers right after stage boundaries, and contexts run past
index_topk, so the handed-on top-k is what the next stage attends with."""

from __future__ import annotations

import pytest
import torch

import glm53.models.model as model_mod
from glm53.models import DFlashConfig, DFlashDraft, ModelRunner, PageAllocator, SeqChunk, StageInput
from glm53.models.draft_checkpoint import draft_config_dict
from glm53.support.oracle import make_checkpoint
from tests.models.oracle_compare import TOPK, IndexGapProbe, rel_err

PAGES, PAGE = 64, 4

# (schedule, splits): indexer types in the comments; each split starts a stage on a shared layer.
CASES = [
    (dict(index_topk_freq=2, index_skip_topk_offset=2),  # F F S F S
     [[range(0, 2), range(2, 5)], [range(0, 2), range(2, 4), range(4, 5)]]),
    (dict(index_topk_pattern="FSFFS"),
     [[range(0, 1), range(1, 5)], [range(0, 1), range(1, 3), range(3, 5)]]),
    # F F F S S: the middle stage has no full layer (no index_k pool) and hands layer 2's top-k through.
    (dict(index_topk_freq=4, index_skip_topk_offset=3, first_k_dense_replace=3),
     [[range(0, 3), range(3, 5)], [range(0, 3), range(3, 4), range(4, 5)]]),
]
PARAMS = [(sched, split) for sched, splits in CASES for split in splits]


def _id(p) -> str:
    sched, split = p
    return "-".join(f"{k}={v}" for k, v in sched.items()) + "/" + "|".join(f"{r.start}-{r.stop}" for r in split)


class TopkRecorder:
    """Records every top-k selection the model makes, in call order."""

    def __init__(self, monkeypatch):
        self.calls: list[torch.Tensor] = []
        inner = model_mod.dsa_topk_paged

        def record(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.calls.append(out.clone())
            return out

        monkeypatch.setattr(model_mod, "dsa_topk_paged", record)

    def take(self) -> list[torch.Tensor]:
        calls, self.calls = self.calls, []
        return calls


def run_pipeline(stages: list[ModelRunner], chunks: list[SeqChunk]) -> list[torch.Tensor]:
    inputs = None
    for r in stages[:-1]:
        out = r.forward_stage(chunks, inputs)
        nxt = stages[stages.index(r) + 1].model.layer_range.start
        assert (out.topk_slots is not None) == (r.cfg.indexer_types[nxt] == "shared")
        assert out.captures == {}
        inputs = out.next_input()
    return stages[-1].forward(chunks, inputs)


@pytest.mark.parametrize("case", PARAMS, ids=_id)
def test_stages_equal_one_stage_model(tmp_path, monkeypatch, case):
    sched, split = case
    make_checkpoint(tmp_path, seed=21, **sched)
    whole = ModelRunner.from_dir(tmp_path, page_size=PAGE, num_pages=PAGES, progress=False)
    stages = [ModelRunner.from_dir(tmp_path, page_size=PAGE, num_pages=PAGES, layers=r, progress=False) for r in split]
    assert sum(len(s.model.model.layers) for s in stages) == whole.cfg.num_hidden_layers
    rec = TopkRecorder(monkeypatch)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (3 * TOPK + 5, 5 * TOPK + 3)]
    decode = 4
    alloc = PageAllocator(PAGES)  # one scheduler's page ids, valid in every stage's pools
    pages = [alloc.alloc(whole.pages_needed(len(p) + decode)) for p in prompts]

    def step(chunks):
        want, want_topk = whole.forward(chunks), rec.take()
        got, got_topk = run_pipeline(stages, chunks), rec.take()
        for w, o in zip(want, got):
            assert rel_err(o, w) <= 1e-6
        assert len(got_topk) == len(want_topk) > 0
        assert all(torch.equal(a, b) for a, b in zip(got_topk, want_topk))
        return got

    # Chunked prefill of both prompts in one batch (16-token chunks), then batched decode steps.
    for s in range(0, max(map(len, prompts)), 16):
        live = [i for i, p in enumerate(prompts) if s < len(p)]
        step([SeqChunk(prompts[i][s : s + 16], s, pages[i], all_logits=True) for i in live])
    toks = [torch.randint(0, 160, (1,), generator=g).item() for _ in prompts]
    for j in range(decode):
        logits = step([SeqChunk([t], len(p) + j, pg) for t, p, pg in zip(toks, prompts, pages)])
        toks = [int(lg[-1].argmax()) for lg in logits]


def test_captures_equal_transformers_hidden_states(tmp_path, monkeypatch):
    ref = make_checkpoint(tmp_path, seed=22, index_topk_freq=2, index_skip_topk_offset=2)
    probe = IndexGapProbe(monkeypatch, TOPK)
    split = [range(0, 2), range(2, 4), range(4, 5)]
    stages = [ModelRunner.from_dir(tmp_path, page_size=PAGE, num_pages=PAGES, layers=r, progress=False) for r in split]
    prompt = torch.randint(0, 160, (6 * TOPK,), generator=torch.Generator().manual_seed(17))
    chunks = [SeqChunk(prompt.tolist(), 0, PageAllocator(PAGES).alloc(stages[0].pages_needed(len(prompt))))]
    want_ids = [(0, 1), (3,), (4,)]  # 4 is the model's last layer: captured after the final norm
    captures, inputs = {}, None
    for r, ids in zip(stages, want_ids):
        out = r.forward_stage(chunks, inputs, capture=ids)
        assert sorted(out.captures) == sorted(ids)
        if r is stages[1]:  # layer 3 ends this stage: its capture is the handed-on stream, pre-norm
            assert torch.equal(out.captures[3], out.hidden)
        captures.update(out.captures)
        inputs = out.next_input()
    with torch.no_grad():
        hs = ref(prompt[None], output_hidden_states=True).hidden_states
    for i, got in captures.items():
        assert rel_err(got, hs[i + 1][0]) <= 1e-4, f"layer {i}"
    probe.assert_well_posed()


def test_captures_inside_a_stage_equal_stage_ends(tmp_path):
    """A layer captured inside a stage is read off the next layer's input norm (the residual sum
    it writes); one ending a stage is the stream handed on. The two must be the same bits."""
    make_checkpoint(tmp_path, seed=24, index_topk_freq=2, index_skip_topk_offset=2)
    whole = ModelRunner.from_dir(tmp_path, page_size=PAGE, num_pages=PAGES, progress=False)
    split = [range(i, i + 1) for i in range(5)]
    stages = [ModelRunner.from_dir(tmp_path, page_size=PAGE, num_pages=PAGES, layers=r, progress=False) for r in split]
    prompt = torch.randint(0, 160, (3 * TOPK,), generator=torch.Generator().manual_seed(29))
    pages = PageAllocator(PAGES).alloc(whole.pages_needed(len(prompt)))
    chunks = [SeqChunk(prompt.tolist(), 0, pages)]
    got = whole.forward_stage(chunks, None, capture=(0, 1, 3, 4)).captures
    inputs = None
    for i, r in enumerate(stages):
        out = r.forward_stage(chunks, inputs, capture=(i,))
        if i in got:
            assert torch.equal(got[i], out.captures[i]), f"layer {i}"
        inputs = out.next_input() if i < 4 else None


def test_bad_capture_and_missing_inputs_raise(tmp_path):
    make_checkpoint(tmp_path, seed=23, index_topk_freq=2, index_skip_topk_offset=2)  # F F S F S
    first = ModelRunner.from_dir(tmp_path, page_size=PAGE, num_pages=PAGES, layers=range(0, 2), progress=False)
    second = ModelRunner.from_dir(tmp_path, page_size=PAGE, num_pages=PAGES, layers=range(2, 5), progress=False)
    ids = torch.randint(0, 160, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    chunks = [SeqChunk(ids, 0, list(range(3)))]
    for bad in (2, 4, -1):
        with pytest.raises(ValueError, match=rf"capture layer {bad} .*\[0, 2\)"):
            first.forward_stage(chunks, capture=(0, bad))
    with pytest.raises(ValueError, match="logits come from the last stage"):
        first.forward(chunks)
    with pytest.raises(ValueError, match="needs the previous stage's StageInput"):
        second.forward_stage(chunks)
    with pytest.raises(ValueError, match="takes no StageInput"):
        first.forward_stage(chunks, StageInput(torch.randn(10, 64), None))
    # A stage starting on a shared layer cannot run without the upstream top-k.
    hidden = first.forward_stage(chunks).hidden
    with pytest.raises(RuntimeError, match="layer 2 shares top-k but no full layer ran before it"):
        second.forward_stage(chunks, StageInput(hidden, None))
    draft_cfg = DFlashConfig.from_dict(draft_config_dict(first.cfg, head_dim=16, intermediate_size=32), first.cfg)
    draft = DFlashDraft(draft_cfg, first.cfg)
    with pytest.raises(ValueError, match="draft model runs on the last stage only"):
        ModelRunner(first.model, num_pages=PAGES, page_size=PAGE, draft=draft)
    ModelRunner(second.model, num_pages=PAGES, page_size=PAGE, draft=draft)
