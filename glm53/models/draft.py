"""The DFlash draft model (z-lab `DFlashDraftModel`): Qwen3-style decoder layers fed by the
target's features through KV injection, with no embeddings or LM head of its own.

Context: the features h_k of the target layers `target_layer_ids` of every committed token are
projected, c = hidden_norm(Σ_k W_k h_k) (`fc` split by column blocks, summed in fp32 so pipeline
stages can each add their own blocks, docs/ARCHITECTURE.md "Capture and partial projection"),
and every draft layer caches K = RoPE(k_norm(W_k c)) and V = W_v c of the token in the
`draft_kv` pool at the token's target slot. Drafting: the block [last token, MASK × (B − 1)],
embedded with the target's embedding at positions start_pos .. start_pos + B − 1, queries the
cached context of [ctx_start, start_pos) and the block itself (non-causal); the target's lm_head
on the final-normed block positions 1 .. B − 1 gives B − 1 proposals.

Tensor parallelism: query and KV heads are split across ranks (q/k/v by heads, o_proj
row-parallel), the MLP by its width; `fc` and the norms are replicated, so every rank computes
the same context c and writes only its own K/V heads.

Draft KV layout: one head-sharded pool `draft_kv`, [num_pages, 2·kv_local, n_layers, page_size,
head_dim], whose heads axis interleaves K and V per KV head (K0, V0, K1, V1, …). The transfer
layer gives TP rank r of tp the contiguous global heads [r·2H/tp, (r+1)·2H/tp) of a `Heads`
buffer (H = num_key_value_heads), which with this order are exactly the K and V of the KV heads
rank r computes; K heads then V heads would hand rank 0 all the K heads instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from glm53.kernels.dispatch import use_triton
from glm53.kernels.draft_attention import attention_bias, draft_attention, draft_attention_gathered, gather_context
from glm53.kernels.norm import add_rms_norm, rms_norm, sum_rms_norm
from glm53.kernels.qk_heads import finish_qk_heads, store_context_kv
from glm53.kernels.rope import rope_cos_sin, rope_inv_freq
from glm53.models.config import GlmConfig
from glm53.models.draft_config import DFlashConfig, check_draft_tp
from glm53.models.draft_projection import feature_parts, project_features
from glm53.models.dspark import BlockChoice, BlockSampling, ConfidenceHead, MarkovHead, choose_block
from glm53.models.fused import FusedLinear
from glm53.models.kv_cache import KVPools, Pool
from glm53.models.layers import MLP, ColumnParallelLinear, Linear, Norm, RowParallelLinear, split
from glm53.models.parallel import TPGroup

DRAFT_KV = "draft_kv"
# The CPU drafting path keeps a transposed copy of the target's lm_head weight up to this size.
LM_HEAD_COPY_MAX_BYTES = 256 << 20


@dataclass
class DraftBlock:
    """One request's draft step: the block [last_token, MASK × (B − 1)] at absolute positions
    start_pos .. start_pos + B − 1, attending to the request's draft KV at positions
    [ctx_start, start_pos) (read through `page_table`, which must cover start_pos tokens).
    `ctx_start > 0` hides positions whose draft KV was never written. `block_size` None: the
    checkpoint's B."""

    last_token: int
    start_pos: int
    page_table: list[int]
    ctx_start: int = 0
    block_size: int | None = None
    sampling: DraftSampling | None = None  # None: propose the draft's argmax
    key: int | None = None  # the request (choice) across steps: the MTP draft keeps per-request state
    # The MTP draft's seed on a request's first decode step: the target's final-normed hidden
    # row [H] at position start_pos − 1 (the prompt's last), sent by prefill in the metadata row.
    seed_hidden: torch.Tensor | None = None
    # The position the request's tokens stop before (prompt + max_new_tokens): a graphed step's
    # device-side advance to the next step keeps every verify inside it (models/spec_state.py).
    end_pos: int | None = None


@dataclass(frozen=True)
class DraftSampling:
    """A sampled request's drafting: the request's temperature (> 0), top-k (0: none), top-p and
    min-p, applied to the draft's logits as the target's sampler applies them to its own; `seed`
    seeds the step's uniforms (the scheduler derives it, so every rank draws the same)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int


@dataclass
class PagedContext:
    """The draft K/V a batch of blocks attends to, read in place from the `draft_kv` pool (no
    gathered copy): request r's context is the pages table[r, 0..W − 1] and `mask` says which of
    their W·page_size slots, then of the B block positions, its queries see (the key mask of
    kernels/draft_attention.py)."""

    pool: torch.Tensor  # the `draft_kv` pool tensor [pages, 2·kv, L, page_size, hd]
    table: torch.Tensor  # [R, W] page ids (entries of pages nothing visible lies in are never read)
    mask: torch.Tensor  # [R, W·page_size + B] bool


@dataclass(frozen=True)
class FusedLayer:
    """One draft layer's weights for the CPU drafting path, each product's transposed ([in, out])
    and this rank's shard: [q; k; v], the q_norm / k_norm weights as one per-head table
    [n_heads + kv, hd], o_proj, [gate; up], down."""

    qkv: torch.Tensor
    qk_norm: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        self.cfg = cfg
        hd, h = cfg.head_dim, cfg.hidden_size
        self.n_heads = split(cfg.num_attention_heads, tp, "num_attention_heads")
        self.n_kv = split(cfg.num_key_value_heads, tp, "num_key_value_heads")
        self.q_proj = ColumnParallelLinear(h, cfg.num_attention_heads * hd, dtype, tp)
        self.k_proj = ColumnParallelLinear(h, cfg.num_key_value_heads * hd, dtype, tp)
        self.v_proj = ColumnParallelLinear(h, cfg.num_key_value_heads * hd, dtype, tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, h, dtype, tp)
        self.q_norm = Norm(hd, dtype)
        self.k_norm = Norm(hd, dtype)
        self.qkv: FusedLinear | None = None

    def fuse_projections_(self) -> int:
        """q, k and v as one product (`models/fused`): they read the same normed rows."""
        if self.qkv is None:
            self.qkv = FusedLinear.of([self.q_proj, self.k_proj, self.v_proj])
        return int(self.qkv is not None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedContext,
                layer: int) -> torch.Tensor:
        """x: block rows [R·B, H]; `ctx` the requests' paged context, of which this is draft layer
        `layer` (its index in the pool)."""
        r = ctx.table.shape[0]
        n, hd, hk = x.shape[0], self.cfg.head_dim, self.n_kv
        b = n // r
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        # q/k norms and RoPE in one op; the queries come back as the attention reads them: a KV
        # head's `group` query heads are more query rows of it, [R, kv, group·B, hd] (the block
        # attends non-causally, so every query row of a request has the same mask), and the K/V
        # are never expanded to the query heads. K is finished in place: it keeps V's strides.
        q = finish_qk_heads(q, k, self.q_norm.weight, self.k_norm.weight, self.cfg.rms_norm_eps, cos, sin, b)
        group = self.n_heads // hk
        kb, vb = k.view(r, b, hk, hd), v.view(r, b, hk, hd)
        if group == 1:  # the attention writes the rows o_proj reads: no copy
            o = torch.empty(n, self.n_heads * hd, dtype=q.dtype, device=q.device)
            draft_attention(q, ctx.pool, layer, ctx.table, kb, vb, ctx.mask, out=o.view(r, b, hk, hd).transpose(1, 2))
        else:
            o = draft_attention(q, ctx.pool, layer, ctx.table, kb, vb, ctx.mask)
            o = o.view(r, hk, group, b, hd).permute(0, 3, 1, 2, 4).reshape(n, self.n_heads * hd)  # [R, B, kv, group, hd]
        return self.o_proj(o)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = Norm(cfg.hidden_size, dtype)
        self.post_attention_layernorm = Norm(cfg.hidden_size, dtype)
        self.self_attn = DraftAttention(cfg, dtype, tp)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, tp)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedContext,
                layer: int, next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual rows; h: this layer's input norm of them. Returns the residual after the
        layer and its norm by `next_norm` (the next layer's input norm, or the draft's final norm):
        each residual add runs inside the norm that follows it (`add_rms_norm`, the same values)."""
        x, h = add_rms_norm(x, self.self_attn(h, cos, sin, ctx, layer), self.post_attention_layernorm.weight, self.eps)
        return add_rms_norm(x, self.mlp(h), next_norm, self.eps)


class DFlashDraft(nn.Module):
    """The draft (this rank's shard of it under `tp`). Parameter names are the checkpoint's
    (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, `hidden_norm.weight`, `norm.weight`, …);
    `check_draft_tp` runs first, so a tp that cannot split it is a `ConfigError` naming the field."""

    def __init__(
        self, cfg: DFlashConfig, target_cfg: GlmConfig, dtype: torch.dtype = torch.float32, tp: TPGroup | None = None,
        confidence_threshold: float = 0.0, cpu_bf16: bool = False,
    ):
        """`cpu_bf16`: for blocks without sampled rows, an fp32 draft's CPU drafting path
        (`_layers_fused`, `_logits_cpu`) multiplies in bf16 (inputs rounded to bf16, weight copies
        held bf16, fp32 out; norms, RoPE, attention and the draft KV stay fp32): 2–3× faster
        products where the CPU multiplies bf16 natively. The context rows' K/V product
        (`write_context`, every request's, at prefill and verify) does too: 4× faster at a
        prompt's rows. Only proposals can change, and the target verifies every one."""
        super().__init__()
        if not 0 <= confidence_threshold < 1:
            raise ValueError(f"confidence_threshold must lie in [0, 1), got {confidence_threshold}")
        self.tp = tp if tp is not None else TPGroup.single()
        check_draft_tp(cfg, self.tp.size)
        if cfg.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"hidden_size: draft {cfg.hidden_size} vs target {target_cfg.hidden_size}")
        self.cfg, self.target_cfg, self.dtype = cfg, target_cfg, dtype
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DraftLayer(cfg, dtype, self.tp) for _ in range(cfg.num_hidden_layers))
        self.fc = Linear(cfg.num_features * h, h, dtype)
        self.hidden_norm = Norm(h, dtype)
        self.norm = Norm(h, dtype)
        # DSpark (models/dspark.py): replicated heads, so every rank picks the same tokens.
        r = cfg.markov_rank
        self.markov_head = MarkovHead(target_cfg.vocab_size, r, dtype) if r else None
        self.confidence_head = ConfidenceHead(h, r, dtype) if r and cfg.confidence_head else None
        if cfg.confidence_head and not r:
            raise ValueError("a confidence head needs a Markov head (its input is [h, markov_w1[token]])")
        self.confidence_threshold = confidence_threshold
        self.cpu_bf16 = cpu_bf16
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)

    # --- the draft KV pool ---
    @property
    def kv_heads_local(self) -> int:
        return self.cfg.num_key_value_heads // self.tp.size

    @property
    def pool_total_heads(self) -> int:
        """Heads of the `draft_kv` pool over all ranks: a K and a V head per KV head."""
        return 2 * self.cfg.num_key_value_heads

    def add_pools(self, pools: KVPools) -> Pool:
        """Adds this rank's `draft_kv` pool (same page ids as the target's pools)."""
        return pools.add(
            DRAFT_KV, self.cfg.draft_layers, (2 * self.kv_heads_local, self.cfg.head_dim), self.dtype,
            total_heads=self.pool_total_heads,
        )

    def kv_bytes_per_token(self) -> int:
        """Draft KV bytes one token costs on this rank."""
        return draft_kv_bytes_per_token(self.cfg, self.dtype, self.tp.size)

    # --- context (KV injection) ---
    def partial_projection(self, captures: Mapping[int, torch.Tensor], acc: torch.Tensor | None = None) -> torch.Tensor:
        """acc + Σ W_k h_k over the feature layers present in `captures` (layer id -> [N, H]),
        fp32 [N, H]. A pipeline stage passes only its own layers."""
        return project_features(self.fc.weight, self.cfg.target_layer_ids, captures, acc)

    def context_of(self, captures: Mapping[int, torch.Tensor], acc: torch.Tensor | None = None) -> torch.Tensor:
        """`context(partial_projection(captures, acc))`. Where kernels run: the products, then
        their sum and the norm in one launch (`sum_rms_norm`: the same values), not a widening
        and an add per product, the norm and a cast."""
        first = next(iter(captures.values()), None)
        if first is None or not use_triton(first):
            return self.context(self.partial_projection(captures, acc))
        parts = feature_parts(self.fc.weight, self.cfg.target_layer_ids, captures)
        return sum_rms_norm(parts, acc, self.hidden_norm.weight, self.cfg.rms_norm_eps, self.dtype)

    def context(self, acc: torch.Tensor) -> torch.Tensor:
        """c = hidden_norm(Σ_k W_k h_k), in the draft's dtype ([N, H])."""
        w, eps = self.hidden_norm.weight, self.cfg.rms_norm_eps
        if use_triton(acc):  # the kernel widens the weight itself: the same fp32 products, no copy
            return rms_norm(acc.float(), w, eps).to(self.dtype)
        return _rms(acc.float(), w.float(), eps).to(self.dtype)  # the reference's values in one op on the CPU

    @torch.inference_mode()
    def write_context(self, c: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor, pools: KVPools) -> None:
        """Every draft layer's K (k_norm, RoPE at `positions`) and V of the context rows `c`
        (not through input_layernorm), written into `draft_kv` at `out_slots`.

        All layers at once: one matmul with every layer's k_proj/v_proj stacked, one norm, one
        RoPE and one store (per layer it was ~20 small ops, which dominate at decode sizes on a
        CPU); the values are those of `DraftAttention.kv` per layer."""
        pool = pools[DRAFT_KV]
        n, nl, kv, hd = c.shape[0], len(self.layers), self.kv_heads_local, self.cfg.head_dim
        eps = self.cfg.rms_norm_eps
        w_kv, w_norm = self._stacked_kv()
        if self.cpu_bf16 and c.dtype == torch.float32 and not use_triton(c):
            x = _mm(c, self._stacked_kv_t(torch.bfloat16)).view(n, nl, 2, kv, hd)
        else:
            x = F.linear(c, w_kv).view(n, nl, 2, kv, hd)
        layers = self._all_layers(pool)  # [pages, page_size, 2·kv, L, hd]; checks the pool's layer order
        if x.dtype == torch.float32 and not use_triton(x):
            # The CPU path: the reference norm and RoPE bit for bit in fewer ops (`_rms`, and the
            # half-split rotation as `_layers_fused` computes it).
            cos, sin = rope_cos_sin(positions, self.inv_freq)
            k = _rms(x[:, :, 0], None, eps) * w_norm
            k = _rope_half(k.reshape(n, nl * kv, hd), cos, sin).view(n, nl, kv, hd)
            # pool heads interleave K and V per KV head: [n, L, kv, 2, hd] -> [n, 2·kv, L, hd]
            vals = torch.stack([k, x[:, :, 1]], dim=3).permute(0, 2, 3, 1, 4).reshape(n, 2 * kv, nl, hd)
            ps = pools.page_size
            layers[out_slots // ps, out_slots % ps] = vals.to(pool.dtype)
        else:  # one op (a kernel where it runs one): norm, rotation and store of every layer's K and V
            store_context_kv(x, w_norm.view(nl, hd), eps, positions, out_slots, self.inv_freq, pool.tensor)

    def _stacked_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(every layer's [k_proj; v_proj] weights stacked [L·2·kv·hd, H], k_norm weights
        [L, 1, hd]); rebuilt whenever a weight was replaced or changed in place (loading)."""
        mods = getattr(self, "_stacked_src", None)
        if mods is None:  # the modules never change, only their parameters (replaced or written)
            mods = self._stacked_src = ([m for la in self.layers for m in (la.self_attn.k_proj, la.self_attn.v_proj)],
                                        [la.self_attn.k_norm for la in self.layers])
        ws = [m._parameters["weight"] for m in mods[0]]
        norms = [m._parameters["weight"] for m in mods[1]]
        key = tuple((w.data_ptr(), w._version, w.device) for w in ws + norms)
        if getattr(self, "_stacked_key", None) != key:
            self._stacked = (torch.cat(ws), torch.stack(norms)[:, None, :])
            self._stacked_key = key
        return self._stacked

    def _stacked_kv_t(self, dtype: torch.dtype) -> torch.Tensor:
        """`_stacked_kv`'s weights transposed [H, L·2·kv·hd] in `dtype` (`cpu_bf16`'s product),
        kept while they are unchanged."""
        w, _ = self._stacked_kv()
        cache = self.__dict__.setdefault("_stacked_t", {})
        if cache.get(dtype, (None,))[0] is not w:
            cache[dtype] = w, w.T.to(dtype).contiguous()
        return cache[dtype][1]

    def _all_layers(self, pool: Pool) -> torch.Tensor:
        """The `draft_kv` pool as [pages, page_size, 2·kv, L, hd] (draft layer i at index i)."""
        if getattr(self, "_checked_pool", None) is not pool.tensor:  # once per pool tensor
            if [pool.index(i) for i in range(len(self.layers))] != list(range(len(self.layers))):
                raise ValueError("draft_kv pool layers are not the draft's layers 0..L-1 in order")
            self._checked_pool = pool.tensor
        return pool.tensor.permute(0, 3, 1, 2, 4)

    # --- drafting ---
    @torch.inference_mode()
    def propose(
        self, target: nn.Module, blocks: list[DraftBlock], pools: KVPools, return_logits: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Proposals [R, B − 1] (long) for the requests `blocks` in one batch (`draft_block`'s
        tokens, before any confidence cut). With `return_logits`, also the draft's fp32 logits
        [R, B − 1, vocab] (DSpark: before the Markov bias)."""
        choice, logits = self.draft_block(target, blocks, pools)
        return (choice.tokens, logits) if return_logits else choice.tokens

    @torch.inference_mode()
    def draft_block(self, target: nn.Module, blocks: list[DraftBlock],
                    pools: KVPools) -> tuple[BlockChoice, torch.Tensor]:
        """The blocks' proposals (`BlockChoice`: tokens [R, B − 1], the confidence cut's `keep`,
        and q of the sampled rows) and the draft's fp32 logits [R, B − 1, vocab]. Block position
        i's proposal: DFlash, the argmax of its logits (a proposal equal to mask_token_id is
        kept); DSpark, of its logits plus the Markov bias of the token chosen before it. A block
        with `sampling` samples from q instead. `target` is the whole target model (its
        embedding and lm_head); every TP rank returns the same values."""
        if not blocks:
            raise ValueError("propose needs at least one block")
        if not (getattr(target, "is_first", False) and getattr(target, "is_last", False)):
            raise ValueError("drafting uses the target's embedding and lm_head: it needs the whole target model")
        b = self._block_size(blocks)
        dev = self.inv_freq.device
        # Built on the host in a few ops (per op, host cost is most of a small block's on a CPU).
        ids = torch.tensor([[blk.last_token] + [self.cfg.mask_token_id] * (b - 1) for blk in blocks]).to(dev)
        positions = torch.tensor([p for blk in blocks for p in range(blk.start_pos, blk.start_pos + b)]).to(dev)
        # Every block query sees the request's valid context and all B block positions.
        table, mask = self._context_pages(blocks, pools.page_size, b)
        ctx = self.paged_context(table.to(dev), mask.to(dev), pools)
        sampling = self.block_sampling(blocks, b - 1, dev)
        # bf16 products for greedy batches only: a sampled row's proposals follow q itself, so they
        # keep the draft's own arithmetic.
        products = torch.bfloat16 if self.cpu_bf16 and sampling is None and self.dtype == torch.float32 else None
        h = self.block_hidden(target, ids, positions, ctx, products)
        logits = self.logits_of(target, h) if use_triton(h) else self._logits_cpu(target, h, products)
        return self.choose(logits, ids[:, 0], h, sampling), logits

    def choose(self, logits: torch.Tensor, anchor: torch.Tensor, hidden: torch.Tensor,
               sampling: BlockSampling | None = None) -> BlockChoice:
        """The proposals of blocks with draft `logits` [R, B − 1, V] (models/dspark.choose_block)."""
        return choose_block(logits, anchor, hidden, self.markov_head, self.confidence_head,
                            self.confidence_threshold, sampling)

    @staticmethod
    def block_sampling(blocks: list[DraftBlock], n: int, device: torch.device) -> BlockSampling | None:
        """The sampled blocks' `BlockSampling` (n uniforms each, from its seed), or None when
        every block proposes its argmax."""
        if all(blk.sampling is None for blk in blocks):
            return None
        rows, t, k, p, m, u = [], [], [], [], [], []
        for blk in blocks:
            s = blk.sampling
            rows.append(s is not None)
            t.append(s.temperature if s else 1.0)
            k.append(s.top_k if s and s.top_k > 0 else 1 << 62)
            p.append(s.top_p if s else 1.0)
            m.append(s.min_p if s else 0.0)
            g = torch.Generator().manual_seed(s.seed) if s else None
            u.append(torch.rand(n, dtype=torch.float64, generator=g) if s else torch.zeros(n, dtype=torch.float64))
        on = lambda v, dt=None: torch.tensor(v, dtype=dt).to(device)  # noqa: E731
        sampled = [blk.sampling for blk in blocks if blk.sampling is not None]
        return BlockSampling(
            rows=on(rows), temperature=on(t, torch.float32), top_k=on(k, torch.long), top_p=on(p, torch.float32),
            min_p=on(m, torch.float32), uniforms=torch.stack(u).to(device),
            sort=any(s.top_k > 0 or s.top_p < 1 for s in sampled), use_min_p=any(s.min_p > 0 for s in sampled))

    def block_hidden(self, target: nn.Module, ids: torch.Tensor, positions: torch.Tensor,
                     ctx: PagedContext, products: torch.dtype | None = None,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The drafting forward on device tensors only (no host reads: CUDA graphs capture it,
        models/spec_graph.py): blocks `ids` [R, B] at `positions` [R·B] over the paged context
        `ctx` (its mask [R, W·page_size + B]); the final-normed hidden [R, B − 1, H] of block
        positions 1 .. B − 1. `products`: the CPU path's product dtype (None: the draft's);
        `rope`: the positions' cos/sin when the caller computed them with its other inputs."""
        r, b = ids.shape
        x = target.embed(ids.reshape(-1)).to(self.dtype)
        cos, sin = rope if rope is not None else rope_cos_sin(positions, self.inv_freq)
        fused = None if use_triton(x) else self._fused_weights(products or self.dtype)
        if fused is not None:
            x = self._layers_fused(x, cos, sin, ctx, fused)
            x = _rms(x, self.norm.weight, self.cfg.rms_norm_eps)  # the reference's values in one op on the CPU
        else:
            h = rms_norm(x, self.layers[0].input_layernorm.weight, self.cfg.rms_norm_eps)
            norms = [la.input_layernorm.weight for la in self.layers[1:]] + [self.norm.weight]
            for i, (layer, next_norm) in enumerate(zip(self.layers, norms)):
                x, h = layer(x, h, cos, sin, ctx, i, next_norm)
            x = h
        return x.view(r, b, -1)[:, 1:]

    def _fused_weights(self, dtype: torch.dtype | None = None) -> list[FusedLayer] | None:
        """Per layer, the weights of the CPU drafting path (`FusedLayer`), products' weights in
        `dtype` (None: the draft's); None when a weight is block-FP8 (the modules' own products
        then). Rebuilt whenever a weight was replaced or changed in place (loading), as
        `_stacked_kv`."""
        src = getattr(self, "_fused_src", None)
        if src is None:  # the modules never change, only their parameters (replaced or written)
            mods = [(la.self_attn, la.mlp) for la in self.layers]
            lins = [m for a, mlp in mods for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj,
                                                    mlp.down_proj)]
            src = self._fused_src = (lins, lins + [n for a, _ in mods for n in (a.q_norm, a.k_norm)])
        if any(m._parameters["weight_scale_inv"] is not None for m in src[0]):
            return None
        dtype = dtype or self.dtype
        key = tuple((w.data_ptr(), w._version) for w in (m._parameters["weight"] for m in src[1]))
        cache = self.__dict__.setdefault("_fused_by_dtype", {})  # one copy per product dtype in use
        if cache.get(dtype, (None,))[0] != key:
            t = lambda *w: torch.cat(w).T.to(dtype).contiguous()  # noqa: E731
            mods = [(la.self_attn, la.mlp) for la in self.layers]
            cache[dtype] = key, [
                FusedLayer(
                    qkv=t(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                    qk_norm=torch.cat([a.q_norm.weight.expand(a.n_heads, -1), a.k_norm.weight.expand(a.n_kv, -1)]),
                    o=t(a.o_proj.weight), gate_up=t(mlp.gate_proj.weight, mlp.up_proj.weight),
                    down=t(mlp.down_proj.weight))
                for a, mlp in mods
            ]
        return cache[dtype][1]

    def _layers_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: PagedContext,
                      fused: list[FusedLayer]) -> torch.Tensor:
        """The draft layers on block rows x [R·B, H] as `DraftLayer.forward` computes them, with
        fewer, cheaper ops (the CPU path, where a step is mostly per-op host cost): every layer's
        context gathered once (kernels/draft_attention.gather_context), one [q; k; v] and one
        [gate; up] product, one norm and one RoPE over the q and k heads, and every product on a
        transposed copy of its weight (a CPU GEMM of a few rows by [in, out] weights takes about
        half the time of one by [out, in]; the values match to rounding)."""
        r = ctx.table.shape[0]
        n, hd, eps, tp = x.shape[0], self.cfg.head_dim, self.cfg.rms_norm_eps, self.tp
        b = n // r
        kv_buf = gather_context(ctx.pool, ctx.table, ctx.mask, b)
        bias = attention_bias(ctx.mask)
        cos2, sin2 = _rope_tables(cos, sin, x.dtype)  # built once for every layer
        half = hd // 2
        for i, (layer, f) in enumerate(zip(self.layers, fused)):
            hq, hk = layer.self_attn.n_heads, layer.self_attn.n_kv
            qkv = _mm(_rms(x, layer.input_layernorm.weight, eps), f.qkv)
            qk = _rms(qkv[:, : (hq + hk) * hd].view(n, hq + hk, hd), None, eps) * f.qk_norm
            qk = qk * cos2 + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * sin2
            v = qkv[:, (hq + hk) * hd :].view(r, b, hk, hd)
            # Query head h reads KV head h // group: [R, kv, group·B, hd] as in DraftAttention.forward.
            g = hq // hk
            q = qk[:, :hq].reshape(r, b, hk, g, hd).permute(0, 2, 3, 1, 4).reshape(r, hk, g * b, hd)
            o = draft_attention_gathered(q, kv_buf, i, qk[:, hq:].reshape(r, b, hk, hd), v, bias)
            x = x + tp.all_reduce(_mm(o.view(r, hk, g, b, hd).permute(0, 3, 1, 2, 4).reshape(n, hq * hd), f.o))
            gu = _mm(_rms(x, layer.post_attention_layernorm.weight, eps), f.gate_up)
            w = gu.shape[1] // 2
            x = x + tp.all_reduce(_mm(F.silu(gu[:, :w]) * gu[:, w:], f.down))
        return x

    def _logits_cpu(self, target: nn.Module, h: torch.Tensor, products: torch.dtype | None = None) -> torch.Tensor:
        """`logits_of` on the CPU: the product by a transposed copy of the target's lm_head
        weight (twice as fast for the B − 1 rows of a block), kept while that weight is unchanged
        and small enough that the copy is cheap next to the model (a CPU run's tiny model)."""
        w = target.lm_head.weight
        if w.numel() * w.element_size() > LM_HEAD_COPY_MAX_BYTES or w.dtype != h.dtype:
            return self.logits_of(target, h)
        dtype, key = products or w.dtype, (w.data_ptr(), w._version, w.device)
        cache = self.__dict__.setdefault("_lm_head_by_dtype", {})
        if cache.get(dtype, (None,))[0] != key:
            cache[dtype] = key, w.T.to(dtype).contiguous()
        r, n, _ = h.shape
        y = _mm(h.reshape(r * n, -1), cache[dtype][1])
        return target.lm_head.tp.all_gather(y, dim=-1).float().view(r, n, -1)

    @staticmethod
    def logits_of(target: nn.Module, h: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """The target's lm_head on the block hidden [R, B − 1, H]: [R, B − 1, vocab], fp32 or
        (`fp32=False`, for `choose`, which casts only where it must) the lm_head's dtype."""
        r, n, _ = h.shape
        y = target.lm_head(h.reshape(r * n, -1))
        return (y.float() if fp32 else y).view(r, n, -1)

    def block_logits(self, target: nn.Module, ids: torch.Tensor, positions: torch.Tensor,
                     ctx: PagedContext) -> torch.Tensor:
        """fp32 logits [R, B − 1, vocab] of block positions 1 .. B − 1 (`block_hidden`)."""
        return self.logits_of(target, self.block_hidden(target, ids, positions, ctx))

    def paged_context(self, table: torch.Tensor, mask: torch.Tensor, pools: KVPools) -> PagedContext:
        """The context of pages `table` [R, W] under `mask` [R, W·page_size + B], read in place
        from this rank's `draft_kv` pool (whose layer i must be draft layer i)."""
        pool = pools[DRAFT_KV]
        self._all_layers(pool)  # checks the layer order
        return PagedContext(pool.tensor, table, mask)

    def _block_size(self, blocks: list[DraftBlock]) -> int:
        sizes = {blk.block_size or self.cfg.block_size for blk in blocks}
        if len(sizes) != 1:
            raise ValueError(f"every block of one propose call needs the same block_size, got {sorted(sizes)}")
        b = sizes.pop()
        if b < 2:
            raise ValueError(f"block_size must be >= 2 (one committed token and at least one draft), got {b}")
        return b

    @staticmethod
    def _context_pages(blocks: list[DraftBlock], page_size: int,
                       block: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [R, W], mask [R, W·page_size + block]): each request's pages first .. first + W − 1
        (the pages of positions lo .. hi − 1, lo the smallest ctx_start and hi the largest
        start_pos; page 0 past a request's table) and which of their slots it sees:
        [ctx_start, start_pos), then `block` more slots it all sees (the block's own)."""
        for blk in blocks:
            if not 0 <= blk.ctx_start <= blk.start_pos:
                raise ValueError(f"ctx_start {blk.ctx_start} must lie in [0, start_pos={blk.start_pos}]")
            if -(-blk.start_pos // page_size) > len(blk.page_table):
                raise ValueError(
                    f"page table of {len(blk.page_table)} pages cannot hold {blk.start_pos} context tokens "
                    f"(page_size={page_size})"
                )
        first = min(blk.ctx_start for blk in blocks) // page_size
        width = max(1, -(-max(blk.start_pos for blk in blocks) // page_size) - first)
        rows = [blk.page_table[first : first + width] for blk in blocks]
        table = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long)
        lo, s = first * page_size, width * page_size
        mask = torch.zeros(len(blocks), s + block, dtype=torch.bool)
        for i, blk in enumerate(blocks):
            mask[i, blk.ctx_start - lo : blk.start_pos - lo] = True
        if block:
            mask[:, s:] = True
        return table, mask


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w, for a weight copy held in another dtype (`DFlashDraft.cpu_bf16`) in w's dtype and
    cast back to x's."""
    return x @ w if w.dtype == x.dtype else (x.to(w.dtype) @ w).to(x.dtype)


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE (half-split) as x·[c, c] + [x2, x1]·[−s, s], the reference's x1·c − x2·s and
    x2·c + x1·s bit for bit: the tables [N, 1, hd] of cos/sin [N, hd/2]."""
    c, s = cos[:, None].to(dtype), sin[:, None].to(dtype)
    return torch.cat([c, c], dim=-1), torch.cat([-s, s], dim=-1)


def _rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope_reference(x, cos, sin, interleave=False)` for x [N, heads, hd], bit for bit."""
    cos2, sin2 = _rope_tables(cos, sin, x.dtype)
    half = x.shape[-1] // 2
    return x * cos2 + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin2


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as kernels/norm.rms_norm_reference computes it; torch's own op
    (one call) for fp32, whose values are the reference's (normalise, then scale), the reference
    otherwise. `weight` None: the normalisation alone."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm(x, weight if weight is not None else x.new_ones(x.shape[-1]), eps)


def draft_kv_bytes_per_token(cfg: DFlashConfig, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one token costs in one TP rank's `draft_kv` pool (K and V of its KV heads, every
    draft layer), for sizing the page pools before the draft is built."""
    per_layer = 2 * (cfg.num_key_value_heads // tp_size) * cfg.head_dim
    return cfg.num_hidden_layers * per_layer * torch.empty((), dtype=dtype).element_size()


def add_draft_pools(pools: KVPools, draft: DFlashDraft) -> Pool:
    """Adds the draft's `draft_kv` pool to `pools` (the target's pools of the last stage)."""
    return draft.add_pools(pools)
