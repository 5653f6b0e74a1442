"""The GLM-5 target model (`GlmMoeDsaForCausalLM`) over the paged latent cache.

One forward serves chunked prefill, decode and speculative verify: every token of the batch
writes its latent (and, on full layers, its indexer key) into its slot first, then attends to
the slots its DSA top-k selects among positions < its context length. Attention always runs in
the absorbed (MQA) form over the latent cache, so prefill and decode share one path.

Parameter names follow the Hugging Face checkpoint (`model.layers.N.self_attn.q_a_proj.weight`);
routed experts are stacked per layer ([E, ...]) and the loader maps `mlp.experts.E.*` into them.

Block-FP8 (GLM-5-FP8): the model is told which parameters the checkpoint stores block-FP8 (`fp8`,
read from the checkpoint by `weights.fp8_param_names`, never assumed by layer type) and holds
those it can as e4m3 + `weight_scale_inv` (the linears, `layers.Linear.to_fp8`; the routed
experts' stacks, `moe.Experts.to_fp8`); the rest of the model stays in `dtype`. kv_b_proj is the one
exception: the absorbed attention reads its W_UK / W_UV slices directly, so it is held in `dtype`
(the loader dequantizes it once); `fp8_dequantized` lists such parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from glm53.kernels import fp8_act, index_cache_fp8, latent_cache_fp8
from glm53.kernels.absorb import absorbed_query
from glm53.kernels.fp8_act import Fp8Rows, rms_norm_fp8, uv_product_fp8, uv_product_reference
from glm53.kernels.indexer_logits import indexer_logits, indexer_logits_fp8
from glm53.kernels.kv_rows import CacheRow, finish_rows, store_rows
from glm53.kernels.linear_f32 import linear_f32
from glm53.kernels.norm import add_rms_norm, rms_norm
from glm53.kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq
from glm53.kernels.row_parts import RowParts, add_rows, take
from glm53.kernels.sparse_mla import sparse_mla
from glm53.kernels.topk import dsa_topk, dsa_topk_paged, positions_to_slots
from glm53.kernels.variants import logits_width
from glm53.models.config import FULL, SHARED, ConfigError, GlmConfig
from glm53.models.fused import FusedLinear
from glm53.models.kv_cache import INDEX_K, LATENT, KVPools
from glm53.models.layers import (
    MLP, ColumnParallelLinear, Linear, Norm, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding,
    norm_for, rows_of, split,
)
from glm53.models import overlap
from glm53.models.moe import MoE
from glm53.models.parallel import TPGroup, check_tp

# transformers' GlmMoeDsa builds q_a_layernorm / kv_a_layernorm with its RMSNorm default eps.
LATENT_NORM_EPS = 1e-6
INDEXER_KEY_NORM_EPS = 1e-6


@dataclass
class ForwardBatch:
    """Flattened tokens of every sequence in the step (N tokens)."""

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long: absolute position of each token
    out_slots: torch.Tensor  # [N] long: physical slot each token's KV is written to
    page_table: torch.Tensor  # [N, max_pages] int32: each token's request's page table row
    context_lens: torch.Tensor  # [N] int32: positions visible to each token (= position + 1)
    max_context: int
    # [N] long or None: positions below ctx_start[i] are hidden from row i (the indexer never
    # selects them): a draft layer's KV that was never written there (the MTP draft on decode
    # when prefill did not send its KV). None: every position < context_lens is visible.
    ctx_start: torch.Tensor | None = None
    # (cos, sin) [N, rope / 2] fp32 of `positions` under the model's RoPE frequencies, when the
    # batch's builder computed them with its other inputs (`DecodeState.batch`); None: the model does
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    _coords: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def out_coords(self, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of each token's KV slot, `out_slots` split by `page_size`: computed at
        the first layer's KV write and reused by every other (two launches a step, not two a
        layer). A batch lives for one forward (a graph replays the split with the forward)."""
        c = self._coords.get(page_size)
        if c is None:
            c = self._coords[page_size] = (self.out_slots // page_size, self.out_slots % page_size)
        return c

    def set_coords(self, page_size: int, page: torch.Tensor, offset: torch.Tensor) -> None:
        """`out_coords(page_size)` computed by the batch's builder with the slots themselves."""
        self._coords[page_size] = (page, offset)


@dataclass
class StageInput:
    """What a stage hands the next one: the residual stream after its last layer and, when the
    next stage starts with shared layers, the top-k slots of the last full layer run so far.
    With a DFlash draft, also the fp32 accumulator of the draft's partial context projection
    (Σ W_k h_k over the feature layers of the stages so far; docs/ARCHITECTURE.md, "Capture and
    partial projection")."""

    hidden: torch.Tensor  # [N, hidden_size]
    topk_slots: torch.Tensor | None  # [N, index_topk] slot ids, or None
    draft_acc: torch.Tensor | None = None  # [N, hidden_size] fp32, or None without a draft


# Rows up to which the last stage takes the final norm in its last add's launch (decode steps and
# verify blocks: every row's logits are wanted); a longer chunk norms only the rows it samples.
FINAL_NORM_ROWS = 1024


@dataclass
class StageOutput:
    hidden: torch.Tensor  # [N, hidden_size]: residual stream after the stage's last layer (pre-norm)
    topk_slots: torch.Tensor | None  # set only when the next stage's first layer is shared
    captures: dict[int, torch.Tensor]  # layer id -> [N, hidden_size] (see forward_stage)
    draft_acc: torch.Tensor | None = None  # set by the runner on non-last stages with a draft projection
    # the last stage's final norm of `hidden`, taken in the last residual add's pass at up to
    # FINAL_NORM_ROWS rows (`GlmForCausalLM.normed_hidden` gives it, or takes it when None)
    normed: torch.Tensor | None = None

    def next_input(self) -> StageInput:
        return StageInput(self.hidden, self.topk_slots, self.draft_acc)


class Indexer(nn.Module):
    """DSA lightning indexer (docs/ARCHITECTURE.md, "DSA"); exists only on "full" layers.

    Replicated under tensor parallelism: every rank computes all indexer heads from the same
    (replicated) inputs, so every rank selects the same top-k, ties included, with no
    communication. Splitting the heads saves little: the indexer's cost is reading every context
    key, and with one key per token shared by all heads each rank would still read them all; only
    the per-head products shrink. It would add an all-reduce of the [tokens, context] fp32 scores
    per full layer, which grows with the context (at 128K, 512 KiB per decode token per full
    layer, against GLM-5's 12 KiB hidden-state all-reduce). Measured on CPU, split was never
    clearly faster (benchmarks/RESULTS.md, "Tensor parallelism").
    """

    def __init__(self, cfg: GlmConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype)
        self.wk = Linear(cfg.hidden_size, cfg.index_head_dim, dtype)
        self.k_norm = Norm(cfg.index_head_dim, dtype, bias=True)
        # Head gates stay fp32 whatever the model dtype (as in the reference checkpoints).
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, torch.float32)
        # With FP8 keys, queries and keys are rotated first (DESIGN "DSA": the rotation is
        # orthonormal, so it only matters where keys are quantized); a width that is not a power of
        # two (no Hadamard matrix) quantizes unrotated keys.
        self.register_buffer("hadamard", self._hadamard(), persistent=False)

    def _hadamard(self) -> torch.Tensor | None:
        d = self.cfg.index_head_dim
        return index_cache_fp8.hadamard(d) if d & (d - 1) == 0 else None

    def init_buffers(self, device: torch.device) -> None:
        """Recomputes the rotation (on the host, as at construction) onto `device`."""
        with torch.device("cpu"):
            rot = self._hadamard()
        self.hadamard = rot.to(device) if rot is not None else None

    def key_row(self, k: torch.Tensor | RowParts, kv: KVPools, layer: int) -> CacheRow | None:
        """The key k = wk(x) as the row `store_rows` finishes (LayerNorm, rope first) into the index
        cache, which holds rows in k's dtype; None for FP8 keys (their own quantizing store)."""
        cache = kv.view(INDEX_K, layer)
        if cache.dtype == torch.uint8:
            return None
        return CacheRow(k, cache, self.k_norm.weight, INDEXER_KEY_NORM_EPS, norm_d=k.shape[1], rope_lo=0,
                        interleave=self.cfg.indexer_rope_interleave, bias=self.k_norm.bias)

    def gates(self, x: torch.Tensor) -> torch.Tensor:
        """The heads' weights of each token's logits, [n, index_n_heads] fp32, from the normed
        hidden state x (the softmax-style scale folded in)."""
        cfg = self.cfg
        scale = cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5
        proj = self.weights_proj
        return proj(x).float() * scale if proj.fp8 else linear_f32(x, proj.weight, scale)

    def forward(self, x, q_resid, cos, sin, batch: ForwardBatch, kv: KVPools, layer: int,
                q_raw: torch.Tensor | None = None, k_raw: torch.Tensor | None = None,
                k_stored: bool = False, gates: torch.Tensor | None = None) -> torch.Tensor:
        """`q_raw` = wq_b(q_resid) and `k_raw` = wk(x) when the caller computed them in its fused
        products (`Attention.fuse_projections_`; `k_raw` may be a sum not taken yet, `row_parts`,
        which the key's store takes); else they are computed here. `k_stored`: the caller stored
        the key row already (`key_row`, with the latent row in one launch). `gates`: `gates(x)`,
        when the caller computed them (beside the main chain, `overlap`)."""
        cfg = self.cfg
        n, rope = x.shape[0], cfg.qk_rope_head_dim
        cache = kv.view(INDEX_K, layer)
        q = (self.wq_b(q_resid) if q_raw is None else q_raw).view(n, cfg.index_n_heads, cfg.index_head_dim)
        k = self.wk(x) if k_raw is None else k_raw
        # The indexer's head layout is [rope | nope], the opposite of MLA's: rotated in place for
        # the FP8 keys, as the logits read it for the bf16 ones (no launch of its own).
        il = cfg.indexer_rope_interleave
        coords = batch.out_coords(kv.page_size)
        weights = self.gates(x) if gates is None else gates
        # the logits width rounded up (kernels/variants.logits_width): one divisibility class for top-k
        args = (batch.page_table, batch.context_lens, logits_width(batch.max_context))
        if cache.dtype == torch.uint8:  # FP8 keys, 132 B/token (kernels/index_cache_fp8)
            apply_rope(q[..., :rope], cos, sin, il, out=q[..., :rope])
            k = take(k)
            finish_rows(k, self.k_norm.weight, INDEXER_KEY_NORM_EPS, cos, sin, norm_d=k.shape[1], rope_lo=0,
                        interleave=il, bias=self.k_norm.bias)
            if self.hadamard is not None:
                q = (q.float() @ self.hadamard).to(q.dtype)
                k = k.float() @ self.hadamard
            cache = cache.flatten(1)  # [num_pages, page_size * (D + 4)]: the page item per layer
            index_cache_fp8.store(cache, batch.out_slots, k, coords=coords)
            logits = indexer_logits_fp8(q, weights, cache, *args)
        else:  # the key normed, rotated and stored in one op (k is not read after it)
            if not k_stored:
                store_rows([self.key_row(k, kv, layer)], coords, cos, sin)
            logits = indexer_logits(q, weights, cache, *args, rope=(cos, sin, il))
        if batch.ctx_start is not None:
            return self._topk_from(logits, batch, kv.page_size)
        return dsa_topk_paged(logits, batch.context_lens, cfg.index_topk, batch.page_table, kv.page_size)

    def _topk_from(self, logits: torch.Tensor, batch: ForwardBatch, page_size: int) -> torch.Tensor:
        """Top-k over positions [ctx_start, context_len) only: hidden positions score the
        lowest value (so the k best visible ones are chosen first whatever the context length),
        and any hidden position still selected (a row with fewer than k visible) becomes -1."""
        pos = torch.arange(logits.shape[1], device=logits.device)
        lo = batch.ctx_start.to(device=logits.device, dtype=torch.long)[:, None]
        hide = pos[None] < lo
        top = dsa_topk(logits.masked_fill(hide, torch.finfo(logits.dtype).min), batch.context_lens, self.cfg.index_topk)
        top = torch.where(top.to(torch.long) < lo, torch.full_like(top, -1), top)
        return positions_to_slots(top, batch.page_table, page_size)


class Attention(nn.Module):
    """MLA with the query heads split across tensor-parallel ranks (q_b_proj and kv_b_proj by
    heads, o_proj row-parallel). The latent projections and norms are replicated, so every rank
    writes the same latent cache and the pools are the same on every rank."""

    def __init__(self, cfg: GlmConfig, layer: int, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        h = cfg.num_attention_heads
        self.n_heads = split(h, tp, "num_attention_heads")  # this rank's heads
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
        self.q_a_layernorm = Norm(cfg.q_lora_rank, dtype)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, h * cfg.qk_head_dim, dtype, tp)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.latent_dim, dtype)
        self.kv_a_layernorm = Norm(cfg.kv_lora_rank, dtype)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype, tp)
        # The absorbed form below reads W_UK / W_UV (slices of this weight) per head, so it stays
        # in the model dtype: a block-FP8 checkpoint's kv_b_proj is dequantized once at load.
        self.kv_b_proj.fp8_ok = False
        self.o_proj = RowParallelLinear(h * cfg.v_head_dim, cfg.hidden_size, dtype, tp)
        self.indexer = Indexer(cfg, dtype) if cfg.indexer_types[layer] == FULL else None
        self.latent_fp8 = latent_cache_fp8.LatentLayout.for_config(cfg) if cfg.kv_lora_rank % 4 == 0 else None
        # q_a, kv_a and the indexer's wk read x; q_b and the indexer's wq_b read q_resid
        self.proj_x: FusedLinear | None = None
        self.proj_q: FusedLinear | None = None

    @property
    def reads_dense(self) -> bool:
        """Whether the normed input is read as is besides its products: the indexer's head gates
        (fp32 weights) read it (`norm_for`)."""
        return self.indexer is not None

    def takes_fp8_rows(self, m: int) -> bool:
        """Whether the products that read the normed input take it quantized (`norm_for`)."""
        if self.proj_x is not None:
            return self.proj_x.takes_fp8_rows(m)
        readers = [self.q_a_proj, self.kv_a_proj_with_mqa] + ([self.indexer.wk] if self.indexer else [])
        return all(p.takes_fp8_rows(m) for p in readers)

    def fuse_projections_(self) -> int:
        """The projections that share an input as one product each (`models/fused`)."""
        ind = self.indexer
        if self.proj_x is None:
            self.proj_x = FusedLinear.of([self.q_a_proj, self.kv_a_proj_with_mqa] + ([ind.wk] if ind else []))
        if self.proj_q is None and ind is not None:
            self.proj_q = FusedLinear.of([self.q_b_proj, ind.wq_b])
        return int(self.proj_x is not None) + int(self.proj_q is not None)

    def _index_first(self, side: torch.cuda.Stream | None, q_in: torch.Tensor | Fp8Rows, n: int) -> bool:
        """Whether q_b and the indexer's wq_b run as two products on two streams (wq_b's first, on
        the main chain) rather than as one fused product: with a side stream, at up to
        `overlap.INDEX_FIRST_MAX_ROWS` rows, when each member reads q_in as it was made."""
        if side is None or self.proj_q is None or n > overlap.INDEX_FIRST_MAX_ROWS:
            return False
        members = (self.q_b_proj, self.indexer.wq_b)
        return not isinstance(q_in, Fp8Rows) or all(m.takes_fp8_rows(n) for m in members)

    def forward(self, x, cos, sin, batch: ForwardBatch, kv: KVPools, topk_slots: torch.Tensor | None,
                x_in: torch.Tensor | Fp8Rows | None = None, keep_parts: bool = False,
                side: torch.cuda.Stream | None = None):
        """x: the normed hidden state; `x_in` its rows quantized for the input products when
        `norm_for` made them (then x may be None unless `reads_dense`). `keep_parts`: o_proj's
        split-K sum may come back not taken yet (`row_parts`), for the norm after it. `side`: a
        stream for the ops off the main chain at decode sizes (`overlap`)."""
        cfg = self.cfg
        x_in = x if x_in is None else x_in
        n, h = rows_of(x_in), self.n_heads
        nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        side = side if n <= overlap.MAX_TOKENS else None
        k_idx = q_idx = None  # the indexer's wk(x) and wq_b(q_resid), when fused here
        if self.proj_x is not None:
            # a split-K product's sum is left to its readers: the q_a norm and the two cache-row
            # stores take it in their own passes (the FP8 caches' finish in place: taken first)
            qa, ckv, *k_idx = self.proj_x(x_in, keep_parts=True)
            k_idx = k_idx[0] if k_idx else None
        else:
            qa, ckv = self.q_a_proj(x_in), self.kv_a_proj_with_mqa(x_in)
            if isinstance(x_in, Fp8Rows) and self.indexer is not None:
                k_idx = self.indexer.wk(x_in)
        # The latent row [norm(c) | rope(k_pe)] is finished in the projection's output (or on its
        # way to the cache) and the query [W_UK q_nope | rope(q_pe)] built in one buffer: no cats.
        cache = kv.view(LATENT, self.layer)
        coords = batch.out_coords(kv.page_size)  # before any fork: every reader shares it
        key = None  # the index key's row, when it is stored with the latent's (one launch)
        # Off the main chain: the cache rows and the indexer's head gates read only the products
        # above and x, beside the q_a norm and the q_b product (FP8 caches finish ckv in place
        # on the main stream, below)
        rows = overlap.Branch(side)
        with rows:
            gates = self.indexer.gates(x) if self.indexer is not None else None
            if cache.dtype != torch.uint8:  # normed, rotated and stored in one op (ckv is not read after it)
                latent = CacheRow(ckv, cache, self.kv_a_layernorm.weight, LATENT_NORM_EPS, norm_d=r, rope_lo=r,
                                  interleave=cfg.rope_interleave)
                key = self.indexer.key_row(k_idx, kv, self.layer) if k_idx is not None else None
                store_rows([latent] if key is None else [latent, key], coords, cos, sin)
        # q_resid feeds q_b (and the indexer's wq_b): quantized in the norm where they take it so;
        # the indexer reads it dense only when its wq_b is not fused into proj_q
        q_reader = self.proj_q if self.proj_q is not None else self.q_b_proj
        q_resid = None
        if q_reader.takes_fp8_rows(n) and (self.proj_q is not None or self.indexer is None):
            _, q_in = rms_norm_fp8(qa, self.q_a_layernorm.weight, LATENT_NORM_EPS)
        else:
            q_resid = q_in = rms_norm(qa, self.q_a_layernorm.weight, LATENT_NORM_EPS)
        # Absorbed form: fold W_UK into the query (with q_pe's rotation: kernels/absorb) and W_UV
        # into the output (per head). The query is off the main chain too, beside the indexer.
        w = self.kv_b_proj.weight.view(h, nope + cfg.v_head_dim, r)
        if self._index_first(side, q_in, n):
            # The indexer's chain (logits, top-k) is the layer's longest; only its own query
            # product feeds it, so q_b and the absorbed query go beside it, after it
            # (`overlap.INDEX_FIRST_MAX_ROWS`)
            if overlap.QUERY_FORKS_FIRST:  # q_b needs only q_in: forked before the indexer's product
                query = overlap.Branch(side)
                q_idx = self.indexer.wq_b(q_in)
            else:
                q_idx = self.indexer.wq_b(q_in)
                query = overlap.Branch(side)
            with query:
                q_all = absorbed_query(self.q_b_proj(q_in).view(n, h, cfg.qk_head_dim), w[:, :nope], cos, sin,
                                       cfg.rope_interleave)
        else:
            if self.proj_q is not None:
                q, q_idx = self.proj_q(q_in)
            else:
                q = self.q_b_proj(q_in)
            query = overlap.Branch(side if self.indexer is not None else None)
            with query:
                q_all = absorbed_query(q.view(n, h, cfg.qk_head_dim), w[:, :nope], cos, sin, cfg.rope_interleave)
        if cache.dtype == torch.uint8:  # the FP8 latent rows (kernels/latent_cache_fp8)
            ckv = take(ckv)
            finish_rows(ckv, self.kv_a_layernorm.weight, LATENT_NORM_EPS, cos, sin, norm_d=r, rope_lo=r,
                        interleave=cfg.rope_interleave)
            latent_cache_fp8.store(cache, batch.out_slots, ckv, self.latent_fp8, coords=coords)
        rows.join()
        if self.indexer is not None:
            topk_slots = self.indexer(x, q_resid, cos, sin, batch, kv, self.layer, q_raw=q_idx, k_raw=k_idx,
                                      k_stored=key is not None, gates=gates)
        elif topk_slots is None:
            raise RuntimeError(f"layer {self.layer} shares top-k but no full layer ran before it")
        query.join()
        # decode sizes: the W_UV product writes o_proj's quantized rows itself (no dense o, no
        # quantizing launch; kernels/fp8_act), and may combine the attention's splits too
        rows_out = fp8_act.uv_writes_rows(n, cfg.v_head_dim, self.o_proj.takes_fp8_rows(n))
        o_lat = sparse_mla(q_all, cache, topk_slots, cfg.softmax_scale, r,
                           keep_splits=rows_out and fp8_act.takes_splits(n))
        if rows_out:
            return self.o_proj(uv_product_fp8(o_lat, w[:, nope:]), keep_parts), topk_slots
        return self.o_proj(uv_product_reference(o_lat, w[:, nope:])), topk_slots


class DecoderLayer(nn.Module):
    def __init__(self, cfg: GlmConfig, layer: int, dtype: torch.dtype, tp: TPGroup, ep: int = 1):
        super().__init__()
        self.layer = layer
        self.input_layernorm = Norm(cfg.hidden_size, dtype)
        self.post_attention_layernorm = Norm(cfg.hidden_size, dtype)
        self.self_attn = Attention(cfg, layer, dtype, tp)
        self.mlp = MoE(cfg, dtype, tp, ep) if cfg.is_moe(layer) else MLP(cfg.hidden_size, cfg.intermediate_size, dtype, tp)
        self.eps = cfg.rms_norm_eps

    def forward(self, x, cos, sin, batch, kv, topk_slots, pending: torch.Tensor | None = None, defer: bool = False,
                side: torch.cuda.Stream | None = None):
        """The residual stream after this layer, and the top-k it hands on. `pending`: the previous
        layer's MLP output not yet added to x; with `defer` this layer's is returned that way too
        (x, mlp_out, top-k, the stream this layer entered with: x + pending, the previous layer's
        output), and each residual add runs inside the norm after it. `side`: the attention's side
        stream (`overlap`)."""
        # each norm writes its output as the products after it read it, with the residual add
        # before it in the same pass (`layers.norm_for`), and the sums that end the attention and
        # (deferred) the MLP taken there too (`row_parts`)
        entry, h, h_in = norm_for(x, self.input_layernorm.weight, self.eps, self.self_attn, add=pending)
        a, topk_slots = self.self_attn(h, cos, sin, batch, kv, topk_slots, x_in=h_in, keep_parts=True, side=side)
        x, h, h_in = norm_for(entry, self.post_attention_layernorm.weight, self.eps, self.mlp, add=a)
        out = self.mlp(h, h_in, keep_parts=defer) if isinstance(self.mlp, MoE) else self.mlp(h_in, keep_parts=defer)
        return (x, out, topk_slots, entry) if defer else (x + out, topk_slots)


class Backbone(nn.Module):
    """`model.*`: embeddings (first stage), decoder layers [start, end), final norm (last stage)."""

    def __init__(self, cfg: GlmConfig, layers: range, dtype: torch.dtype, tp: TPGroup, ep: int = 1):
        super().__init__()
        self.first, self.last = layers.start == 0, layers.stop == cfg.num_hidden_layers
        if self.first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        # Keyed by the global layer id so parameter names match the checkpoint under PP too.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, dtype, tp, ep) for i in layers})
        if self.last:
            self.norm = Norm(cfg.hidden_size, dtype)


def fp8_block(cfg: GlmConfig) -> int:
    """The block edge of a checkpoint whose FP8 weights are kept FP8 (128: the FP8 kernels')."""
    if cfg.quant_method != "fp8":
        raise ConfigError("quantization_config.quant_method: block-FP8 weights need 'fp8'")
    if tuple(cfg.weight_block_size) != (128, 128):
        raise ConfigError(f"quantization_config.weight_block_size: FP8 weights are kept FP8 only with [128, 128] "
                          f"blocks (the FP8 kernels'), got {list(cfg.weight_block_size)}; load with dtype bfloat16 "
                          f"to dequantize them at load")
    return 128


class GlmForCausalLM(nn.Module):
    """The target model, or one pipeline stage of it: decoder layers `layers` (global ids), with
    the embeddings on the first stage and the final norm + lm_head on the last.

    `tp` is this rank's tensor-parallel group (a trivial single-rank group by default); the
    module then holds this rank's shard of every split parameter, and each rank's forward
    returns the same full logits. `ep` (dividing tp) partitions the routed experts over ep
    groups of the tp ranks (`expert_parallel`; tokens reach them by all-to-all, `ep_dispatch`).
    `check_tp` runs first, so a tp or ep that does not divide a split dimension is a
    `ConfigError` naming it.

    `fp8`: the parameter names (this model's naming: a routed-expert stack is
    `...mlp.experts.<proj>`) that the checkpoint stores block-FP8, from `weights.fp8_param_names`;
    those with an FP8 form are held e4m3 + scales (`fp8_params`), the others in `dtype`
    (`fp8_dequantized`: the loader dequantizes them). Names of other stages are ignored. Empty
    (the default): every weight in `dtype`, FP8 ones dequantized at load. Kept-FP8 weights need
    the checkpoint's `weight_block_size` to be [128, 128] (the FP8 kernels')."""

    def __init__(
        self,
        cfg: GlmConfig,
        dtype: torch.dtype = torch.float32,
        layers: range | None = None,
        tp: TPGroup | None = None,
        fp8: frozenset[str] | set[str] = frozenset(),
        ep: int = 1,
    ):
        super().__init__()
        self.tp = tp if tp is not None else TPGroup.single()
        self.ep = ep
        fp8 = frozenset(fp8)
        check_tp(cfg, self.tp.size, fp8, ep)
        self.cfg = cfg
        self.dtype = dtype
        self.layer_range = layers if layers is not None else range(cfg.num_hidden_layers)
        r, n = self.layer_range, cfg.num_hidden_layers
        if r.step != 1 or not 0 <= r.start < r.stop <= n:
            raise ValueError(f"layers must be a non-empty range [a, b) within [0, {n}), got {r}")
        self.model = Backbone(cfg, self.layer_range, dtype, self.tp, ep)
        if self.model.last:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, dtype, self.tp)
        # The next stage needs our top-k only when its first layer is shared (it reuses the
        # nearest preceding full layer's selection).
        self.hands_on_topk = not self.model.last and cfg.indexer_types[r.stop] == SHARED
        self.register_buffer("inv_freq", rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta), persistent=False)
        self.fp8_params: frozenset[str] = frozenset()
        self.fp8_dequantized: frozenset[str] = frozenset()
        # the stream the attention's ops off the main chain run on at decode sizes (`overlap`);
        # set by the runner that serves this model on a GPU
        self.side_stream: torch.cuda.Stream | None = None
        if fp8:
            self._to_fp8(fp8)

    def _to_fp8(self, fp8: frozenset[str]) -> None:
        block = fp8_block(self.cfg)
        held: set[str] = set()
        for prefix, module in self.named_modules():
            convert = getattr(module, "to_fp8", None)
            if convert is not None:
                held |= convert(prefix, fp8, block)
        own = set(dict(self.named_parameters()))
        self.fp8_params = frozenset(held)
        self.fp8_dequantized = frozenset(n for n in fp8 if n in own and n not in held)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recomputes the non-persistent buffers (RoPE frequencies, the indexer rotations) on the
        host, as construction does, and puts them on `device`: what a model built on the meta
        device and materialized there (`layers.materialize_`) needs."""
        device = torch.device(device)
        self.inv_freq = rope_inv_freq(self.cfg.qk_rope_head_dim, self.cfg.rope_theta).to(device)
        for m in self.modules():
            if isinstance(m, Indexer):
                m.init_buffers(device)

    @property
    def is_first(self) -> bool:
        return self.model.first

    @property
    def is_last(self) -> bool:
        return self.model.last

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.model.norm.weight, self.cfg.rms_norm_eps)

    def normed_hidden(self, out: StageOutput, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The final norm of a last stage's output rows (`rows`, a device index or a slice, or all):
        the one its last add's launch took, else taken now of those rows only."""
        if out.normed is not None:
            return out.normed if rows is None else out.normed[rows]
        return self.final_norm(out.hidden if rows is None else out.hidden[rows])

    @torch.inference_mode()
    def head(self, hn: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed rows; last stage only."""
        return self.lm_head(hn).float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of residual-stream rows (before the final norm); last stage only."""
        return self.head(self.final_norm(x))

    def check_capture(self, capture: Sequence[int]) -> frozenset[int]:
        r = self.layer_range
        for i in capture:
            if i not in r:
                raise ValueError(f"capture layer {i} is outside this stage's layers [{r.start}, {r.stop})")
        return frozenset(capture)

    @torch.inference_mode()
    def forward_stage(
        self, batch: ForwardBatch, kv: KVPools, inputs: StageInput | None, capture: Sequence[int] = ()
    ) -> StageOutput:
        """Runs this stage's layers on `batch`, writing their KV into `kv`.

        `inputs` is what the previous stage handed on; the first stage takes None and embeds
        `batch.input_ids`. `capture` lists global layer ids of this stage whose output to return:
        `captures[i]` is the residual stream after layer i, before any norm (Hugging Face's
        `hidden_states[i + 1]`), except for the model's last layer, where it is the output after
        the final norm, as the DFlash reference (and Hugging Face's last hidden state) has it.
        """
        want = self.check_capture(capture)
        if self.is_first:
            if inputs is not None:
                raise ValueError("the first stage embeds batch.input_ids; it takes no StageInput")
            x, topk_slots = self.embed(batch.input_ids), None
        else:
            if inputs is None:
                start = self.layer_range.start
                raise ValueError(f"stage starting at layer {start} needs the previous stage's StageInput")
            x, topk_slots = inputs.hidden, inputs.topk_slots
        captures: dict[int, torch.Tensor] = {}
        cos, sin = batch.rope if batch.rope is not None else rope_cos_sin(batch.positions, self.inv_freq)
        pending = None  # a layer's MLP output, added inside the next layer's first norm
        held = None  # a captured layer whose output is the next layer's entry (that norm's sum)
        for layer in self.model.layers.values():
            x, pending, topk_slots, entry = layer(x, cos, sin, batch, kv, topk_slots, pending=pending, defer=True,
                                                  side=self.side_stream)
            if held is not None:
                captures[held], held = entry, None
            if layer.layer in want:
                held = layer.layer
        normed = None
        if pending is not None and self.is_last and x.shape[0] <= FINAL_NORM_ROWS:
            # the last layer's sum, the residual add and the final norm in one launch
            x, normed = add_rms_norm(x, pending, self.model.norm.weight, self.cfg.rms_norm_eps)
        elif pending is not None:
            x = add_rows(x, pending)  # the last layer's sum taken in the add's launch
        if held is not None:  # the stage's last layer: its output is the stage's
            last = held == self.cfg.num_hidden_layers - 1
            captures[held] = (normed if normed is not None else self.final_norm(x)) if last else x
        return StageOutput(x, topk_slots if self.hands_on_topk else None, captures, normed=normed)

    def forward(self, batch: ForwardBatch, kv: KVPools, logit_rows: torch.Tensor | slice) -> torch.Tensor:
        """Full model (single stage): logits of rows `logit_rows` [rows, vocab] in fp32."""
        if not (self.is_first and self.is_last):
            raise ValueError(f"forward needs the whole model; this stage holds layers {self.layer_range}")
        return self.head(self.normed_hidden(self.forward_stage(batch, kv, None), logit_rows))
