"""tools/distill_draft.py's pieces that decide what the draft learns: anchors only where the labels
are the target's own tokens, and a deeper draft that starts as the function of the draft it
grows from. Tiny shapes, CPU, no transformers model."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from tools.distill_draft import anchor_start, init_from, sample_anchors
from tools.train_tiny import DraftTrainer


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
