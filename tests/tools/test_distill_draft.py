"""tools/distill_draft.py's pieces (glm53/support/draft_distill.py, distill_data.py) that decide
what the draft learns and how it is judged: anchors only where the labels are the target's own
tokens; a deeper draft that starts as the function of the draft it grows from; the lockstep
generation (the serving model's greedy tokens and the features its forward captures); the replay
of the greedy decode loop that gives τ. Tiny shapes, CPU."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from glm53.support.distill_data import Data, anchor_start, generate
from glm53.support.draft_distill import init_from, replay_tau, sample_anchors
from glm53.support.draft_trainer import DraftTrainer


def _cfg(layers: int) -> dict:
    return {"hidden_size": 32, "rms_norm_eps": 1e-6, "block_size": 4, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48, "num_hidden_layers": layers,
            "rope_theta": 10000.0, "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 63}}


def test_anchors_stay_where_the_labels_are_the_targets_own():
    g = torch.Generator().manual_seed(0)
    starts = torch.tensor([anchor_start(10, "greedy"), anchor_start(10, "sampled head"), anchor_start(40, "sampled")])
    assert starts.tolist() == [9, 33, 39]
    seq, B = 64, 4
    for _ in range(20):
        a = sample_anchors(starts, 8, seq, B, g)
        assert (a >= starts[:, None]).all() and (a <= seq - B).all()
        assert all(len(set(row.tolist())) == 8 for row in a)  # drawn without replacement
        assert torch.equal(a, a.sort(-1).values)


def test_a_deeper_draft_starts_as_the_draft_it_grows_from(tmp_path):
    torch.manual_seed(0)
    small = DraftTrainer(_cfg(2))
    with torch.no_grad():
        for p in small.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    save_file({k: v.contiguous() for k, v in small.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(_cfg(2)))
    torch.manual_seed(1)
    deep = DraftTrainer(_cfg(3))
    init_from(deep, tmp_path)
    ids = torch.randint(0, 60, (2, 24))
    feats = torch.randn(2, 24, 64)
    anchors = torch.tensor([[3, 11, 19], [0, 8, 20]])
    embed, head = torch.randn(64, 32), torch.randn(64, 32)
    with torch.no_grad():
        want = small(ids, feats, anchors, embed, head)
        got = deep(ids, feats, anchors, embed, head)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and the new layer is trainable from there: its zeroed output projections get gradients
    deep(ids, feats, anchors, embed, head).square().mean().backward()
    assert deep.layers[2].self_attn.o_proj.weight.grad.abs().sum() > 0


def test_lockstep_generation_is_the_serving_models_greedy_decode_and_its_features(tmp_path):
    from glm53.models import ModelRunner, PageAllocator, SeqChunk
    from glm53.support.oracle import make_checkpoint

    make_checkpoint(tmp_path, seed=3, index_topk_freq=2, index_skip_topk_offset=2)
    ids, n, plen, total = [0, 2], 3, 7, 19
    runner = ModelRunner.from_dir(tmp_path, page_size=4, num_pages=64, progress=False)
    prompts = torch.randint(0, 150, (n, plen), generator=torch.Generator().manual_seed(4))
    tokens = torch.zeros(n, total, dtype=torch.long)
    feats = torch.full((n, total, 2 * runner.cfg.hidden_size), float("nan"))
    generate(runner, prompts, "greedy", torch.Generator(), tokens, feats, ids, prefill_rows=2)
    # the reference: ModelRunner.forward one sequence at a time, prefill then one token a step
    ref = ModelRunner.from_dir(tmp_path, page_size=4, num_pages=64, progress=False)
    for i in range(n):
        pages = PageAllocator(64).alloc(5)
        seq = prompts[i].tolist()
        logits = ref.forward([SeqChunk(seq, 0, pages)])[0][-1]
        while len(seq) < total:
            seq.append(int(logits.argmax()))
            logits = ref.forward([SeqChunk(seq[-1:], len(seq) - 1, pages)])[0][-1]
        assert tokens[i].tolist() == seq
        # features: what one prefill over the whole sequence captures at the draft's layers
        out = ref.model.forward_stage(ref.build_batch([SeqChunk(seq, 0, pages)])[0], ref.pools, None, capture=ids)
        want = torch.cat([out.captures[j] for j in ids], -1)
        torch.testing.assert_close(feats[i, :-1], want[:-1], rtol=1e-4, atol=1e-4)
        assert (feats[i, -1] == 0).all()  # never fed


class ScriptedDraft:
    """A draft double: at anchor p it proposes the true tokens, except at positions in `miss`."""

    def __init__(self, B: int, miss: set[int], vocab: int = 32):
        self.B, self.miss, self.V = B, miss, vocab

    def __call__(self, x, f, anchors, embed, head):
        R = len(x)
        pos = anchors + torch.arange(1, self.B)  # [R, B - 1]
        want = x.gather(1, pos)
        wrong = torch.tensor([[int(q) in self.miss for q in row] for row in pos.tolist()], dtype=torch.bool)
        prop = torch.where(wrong, (want + 1) % self.V, want)
        return torch.nn.functional.one_hot(prop, self.V).float().view(R, 1, self.B - 1, self.V)


def test_replay_tau_is_the_greedy_decode_loop():
    """τ from the replay equals the decode loop written out: from the first generated token (the
    first bonus), each step commits the matching prefix of the block plus the target's token."""
    S, B, new = 60, 4, 30
    plens = [10, 13, 10]
    x = torch.randint(0, 32, (3, S), generator=torch.Generator().manual_seed(5))
    miss = {12, 13, 20, 27, 28, 29, 33, 41}
    held = Data(x, torch.zeros(3, S, 1), torch.tensor(plens) - 1, torch.ones(3, dtype=torch.bool),
                torch.tensor(plens), m=3)
    steps = toks = 0
    for p in plens:  # the loop, one request at a time
        end, pos = p + new - 1, p
        while pos < end:
            accepted = 0
            while accepted < B - 1 and pos + 1 + accepted not in miss:
                accepted += 1
            commit = min(accepted + 1, end - pos)
            pos, steps, toks = pos + commit, steps + 1, toks + commit
    got = replay_tau(ScriptedDraft(B, miss), held, (None, None), torch.device("cpu"), B, new, rows=2)
    assert toks == 3 * (new - 1)
    assert abs(got - toks / steps) < 1e-12


def test_a_dspark_checkpoint_gives_its_own_body(tmp_path):
    # --dspark-joint --init-dspark continues from the DSpark checkpoint's body (trained with its
    # heads), whose file also holds the heads' tensors: those are skipped, the body copied whole
    torch.manual_seed(2)
    body = DraftTrainer(_cfg(2))
    sd = {k: (v + 0.3 * torch.randn(v.shape)).contiguous() for k, v in body.state_dict().items()}
    heads = {"markov_head.markov_w1.weight": torch.randn(64, 8), "markov_head.markov_w2.weight": torch.randn(64, 8)}
    save_file({**sd, **heads}, str(tmp_path / "model.safetensors"))
    fresh = DraftTrainer(_cfg(2))
    init_from(fresh, tmp_path)
    for k, v in fresh.state_dict().items():
        torch.testing.assert_close(v, sd[k].float(), rtol=0, atol=0)
