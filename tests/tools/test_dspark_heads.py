"""DSpark's training pieces (glm53/support/dspark_heads.py, tools/distill_draft.py --dspark-rank and
--dspark-joint): the heads' loss against the DFlash loss and its gradients, the replay of the
DSpark chain against a chain computed by hand, and the checkpoint the heads are saved in.
Tiny shapes, CPU, random inputs."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from glm53.support.distill_data import Data
from glm53.support.draft_trainer import draft_loss
from glm53.support.dspark_heads import DSparkHeads, heads_loss, load_heads, replay_tau_dspark, save_dspark, widen

V, H, R = 40, 12, 5


def _blocks(seed: int, B: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (3, 30), generator=g)
    anchors = torch.sort(torch.randint(0, 30 - B, (3, 5), generator=g), -1).values
    h = torch.randn(3, 5, B - 1, H, generator=g)
    lm_head = torch.randn(V, H, generator=g)
    return x, anchors, h, lm_head


def test_with_no_markov_bias_the_loss_is_dflashs():
    """markov_w2 = 0 (how fresh heads start) leaves the logits the draft's own, so the Markov CE
    is the DFlash loss of those logits."""
    x, anchors, h, lm_head = _blocks(1)
    heads = DSparkHeads(V, H, R)
    ce, _, acc = heads_loss(heads, h, lm_head, x, anchors, 4)
    ref, ref_acc = draft_loss(F.linear(h, lm_head), x, anchors, 4)
    assert torch.allclose(ce, ref, rtol=1e-6, atol=1e-6)
    assert torch.allclose(acc, ref_acc)


def test_the_bias_is_the_low_rank_product_of_the_previous_token():
    heads = DSparkHeads(V, H, R, seed=3)
    with torch.no_grad():
        heads.markov_head.markov_w2.weight.normal_()
    base, prev = torch.randn(7, V), torch.randint(0, V, (7,))
    w1, w2 = heads.markov_head.markov_w1.weight, heads.markov_head.markov_w2.weight
    want = torch.stack([base[i] + w2 @ w1[prev[i]] for i in range(7)])
    assert torch.allclose(heads.logits(base, prev), want, atol=1e-5)


def test_joint_training_reaches_the_body_and_frozen_training_does_not():
    x, anchors, h, lm_head = _blocks(2)
    heads = DSparkHeads(V, H, R)
    with torch.no_grad():
        heads.markov_head.markov_w2.weight.normal_()
    for train_body in (False, True):
        hh = h.clone().requires_grad_(True)
        ce, bce, _ = heads_loss(heads, hh, lm_head, x, anchors, 4, train_body=train_body)
        (ce + bce).backward()
        # the confidence head reads h detached: with a frozen body nothing reaches h at all
        assert (hh.grad is not None and hh.grad.abs().sum() > 0) == train_body
        assert heads.markov_head.markov_w2.weight.grad.abs().sum() > 0
        heads.zero_grad()
    # the body's gradient is the Markov CE's alone: the confidence BCE adds nothing to it
    hh = h.clone().requires_grad_(True)
    ce, _, _ = heads_loss(heads, hh, lm_head, x, anchors, 4, train_body=True)
    (g_ce,) = torch.autograd.grad(ce, hh)
    hh2 = h.clone().requires_grad_(True)
    ce2, bce2, _ = heads_loss(heads, hh2, lm_head, x, anchors, 4, train_body=True)
    (g_all,) = torch.autograd.grad(ce2 + bce2, hh2)
    assert torch.allclose(g_ce, g_all)


class _FlatDraft:
    """A draft whose block hidden is zero everywhere: with lm_head = 0 its base logits are flat,
    so the proposals are the Markov chain alone."""

    def __init__(self, B: int):
        self.B = B

    def __call__(self, ids, feats, anchors, embed, lm_head):
        R, N = anchors.shape
        return torch.zeros(R, N, self.B - 1, H)


def test_replay_follows_the_markov_chain_computed_offline():
    """A Markov head that maps token t to (t + 1) mod V (rank V, one-hot) proposes the chain
    anchor + 1, + 2, ...; the sequences follow that chain except at known positions, so τ of the
    greedy loop is computable by hand."""
    B, new, S = 4, 24, 48
    heads = DSparkHeads(V, H, V)
    with torch.no_grad():
        heads.markov_head.markov_w1.weight.copy_(torch.eye(V))
        heads.markov_head.markov_w2.weight.copy_(10 * torch.roll(torch.eye(V), 1, 0))  # row t+1 reads t
    plens = [8, 11]
    breaks = {13: 5, 14: 9, 21: 2, 30: 17}  # position -> a token off the chain
    x = torch.zeros(2, S, dtype=torch.long)
    for r, p in enumerate(plens):
        x[r, 0] = 3 + r
        for i in range(1, S):
            x[r, i] = breaks.get(i, (x[r, i - 1].item() + 1) % V)
    held = Data(x, torch.zeros(2, S, 1), torch.tensor(plens) - 1, torch.ones(2, dtype=torch.bool),
                torch.tensor(plens), m=2)
    steps = toks = 0
    for r, p in enumerate(plens):
        end, pos = p + new - 1, p
        while pos < end:
            prev, accepted = x[r, pos].item(), 0
            while accepted < B - 1:
                prop = (prev + 1) % V
                if prop != x[r, pos + 1 + accepted].item():
                    break
                prev, accepted = prop, accepted + 1
            commit = min(accepted + 1, end - pos)
            pos, steps, toks = pos + commit, steps + 1, toks + commit
    w = (torch.zeros(V, H), torch.zeros(V, H))
    tau, per = replay_tau_dspark(_FlatDraft(B), heads, held, w, torch.device("cpu"), B, new)
    assert abs(tau - toks / steps) < 1e-12 and per == B - 1
    flat, _ = replay_tau_dspark(_FlatDraft(B), None, held, w, torch.device("cpu"), B, new)
    assert flat < tau  # without the head every proposal is token 0


def test_heads_saved_with_a_body_load_back(tmp_path):
    body = tmp_path / "dspark"
    body.mkdir()
    (body / "config.json").write_text(json.dumps({"hidden_size": H, "dflash_config": {"mask_token_id": V - 1}}))
    save_file({"fc.weight": torch.randn(H, 2 * H)}, str(body / "model.safetensors"))
    heads = DSparkHeads(V, H, R, seed=4)
    with torch.no_grad():
        heads.markov_head.markov_w2.weight.normal_()
        heads.confidence_head.proj.weight.normal_()
    save_dspark(body, heads, body, dtype=torch.float32)  # in place, as a joint run saves
    cfg = json.loads((body / "config.json").read_text())
    assert "dspark_config" in cfg and "dflash_config" not in cfg
    assert "fc.weight" in load_file(str(body / "model.safetensors"))
    back = load_heads(body)
    for (k, a), (k2, b) in zip(heads.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    base, prev = torch.randn(6, V), torch.randint(0, V, (6,))
    wide = load_heads(body, 2 * R)  # a joint run's --dspark-rank above the checkpoint's
    assert wide.markov_head.markov_w1.weight.shape == (V, 2 * R)
    torch.testing.assert_close(wide.logits(base, prev), heads.logits(base, prev))


def test_widened_heads_compute_what_they_did():
    """load_heads(..., rank) above the checkpoint's: same Markov logits and confidence on fresh
    inputs, the new columns of markov_w1 not zero (training can use them at once)."""
    g = torch.Generator().manual_seed(8)
    heads = DSparkHeads(V, H, R, seed=5)
    with torch.no_grad():
        heads.markov_head.markov_w2.weight.normal_(generator=g)
        heads.confidence_head.proj.weight.normal_(generator=g)
        heads.confidence_head.proj.bias.normal_(generator=g)
    wide = widen(heads, 4 * R)
    assert wide.markov_head.markov_w1.weight.shape == (V, 4 * R)
    assert wide.markov_head.markov_w1.weight[:, R:].abs().sum() > 0
    base, prev, h = torch.randn(6, V, generator=g), torch.randint(0, V, (6,), generator=g), torch.randn(6, H, generator=g)
    torch.testing.assert_close(wide.logits(base, prev), heads.logits(base, prev))
    torch.testing.assert_close(wide.confidence_logit(h, prev), heads.confidence_logit(h, prev))
