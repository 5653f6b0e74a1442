"""A differentiable forward of the MTP layer (models/mtp.py) for training it on the frozen
target's own sequences (tools/train_mtp.py).

The serving forward writes paged KV with out= kernels, which autograd cannot follow, so training
runs the same formulas on whole sequences: NextN input, MLA in its plain (non-absorbed) form,
and the layer's own MoE (CPU reference kernels, differentiable). DSA is kept exact: each query
attends only to the keys the layer's indexer selects, and the selection (not differentiable, as
in the serving path) is taken from the serving indexer itself over a scratch paged batch, so a
context longer than index_topk trains on what serving will attend to. The indexer's weights are
not trained here (they come from the initialisation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glm53.kernels.norm import rms_norm
from glm53.kernels.rope import apply_rope, rope_cos_sin
from glm53.models.model import LATENT_NORM_EPS, ForwardBatch
from glm53.models.mtp import NextNDraft


def dsa_mask(draft: NextNDraft, x_norm: torch.Tensor, q_resid: torch.Tensor, cos, sin, batch: ForwardBatch,
             seq: int) -> torch.Tensor:
    """[N, S] bool: the keys (sequence positions) the serving indexer selects for each row, for
    rows laid out as B sequences of `seq` tokens whose page tables are contiguous runs."""
    ind = draft.layer.self_attn.indexer
    with torch.no_grad():
        slots = ind(x_norm.detach(), q_resid.detach(), cos, sin, batch, draft.kv, draft.spec.layer)
    ps = draft.kv.page_size
    first = batch.page_table[:, 0].to(torch.long)[:, None] * ps
    pos = torch.where(slots >= 0, slots.to(torch.long) - first, torch.full_like(slots, seq, dtype=torch.long))
    mask = torch.zeros(len(pos), seq + 1, dtype=torch.bool, device=pos.device)
    mask.scatter_(1, pos, True)
    return mask[:, :seq]


def train_rows(draft: NextNDraft, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
               seq: int) -> torch.Tensor:
    """h' (shared_head.norm output) of B·S rows, B sequences of `seq` positions 0..S-1 each:
    what `NextNDraft.rows` computes, with gradients."""
    cfg, L = draft.cfg, draft.layer
    eps = cfg.rms_norm_eps
    n = next_ids.shape[0]
    b = n // seq
    e = rms_norm(draft.embed(next_ids).to(draft.dtype), L.enorm.weight, eps)
    h = rms_norm(hidden.to(draft.dtype), L.hnorm.weight, eps)
    x = F.linear(torch.cat([e, h], dim=-1), L.eh_proj.weight)
    cos, sin = rope_cos_sin(batch.positions, draft.inv_freq)
    a = L.self_attn
    xn = rms_norm(x, L.input_layernorm.weight, eps)
    q_resid = rms_norm(F.linear(xn, a.q_a_proj.weight), a.q_a_layernorm.weight, LATENT_NORM_EPS)
    nh, nope, rope, r, vd = a.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    q = F.linear(q_resid, a.q_b_proj.weight).view(n, nh, nope + rope)
    ckv = F.linear(xn, a.kv_a_proj_with_mqa.weight)
    c = rms_norm(ckv[:, :r], a.kv_a_layernorm.weight, LATENT_NORM_EPS)
    k_pe = apply_rope(ckv[:, r:], cos, sin, cfg.rope_interleave)
    q_pe = apply_rope(q[..., nope:], cos, sin, cfg.rope_interleave)
    kv = F.linear(c, a.kv_b_proj.weight).view(n, nh, nope + vd)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    allowed = dsa_mask(draft, xn, q_resid, cos, sin, batch, seq).view(b, seq, seq)
    qn, qp = q[..., :nope].view(b, seq, nh, nope), q_pe.reshape(b, seq, nh, rope)
    kn, kp, vv = k_nope.reshape(b, seq, nh, nope), k_pe.reshape(b, seq, rope), v.reshape(b, seq, nh, vd)
    scores = torch.einsum("bqhd,bkhd->bhqk", qn, kn) + torch.einsum("bqhd,bkd->bhqk", qp, kp)
    scores = (scores * cfg.softmax_scale).masked_fill(~allowed[:, None], float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vv).reshape(n, nh * vd)
    x = x + F.linear(o, a.o_proj.weight)
    x = x + L.mlp(rms_norm(x, L.post_attention_layernorm.weight, eps))
    return rms_norm(x, L.shared_head.norm.weight, eps)
