"""GLM-5's own multi-token-prediction layer (NextN, the DeepSeek-V3 layout) as a speculative draft.

Checkpoint layout: layer index L = num_hidden_layers holds a full decoder layer
`model.layers.L.{input_layernorm, self_attn (MLA + its own DSA indexer), post_attention_layernorm,
mlp}` (the MoE of the target's sparse layers, or a dense MLP when the checkpoint has no experts
there) plus `enorm`, `hnorm`, `eh_proj` [H, 2H], `shared_head.norm` and optionally
`shared_head.head` (absent: the target's lm_head) and `embed_tokens` (absent: the target's
`model.embed_tokens`, which this module then loads itself, so a last pipeline stage without the
target's embedding can run it). Block-FP8 like the target (`weight_scale_inv` beside FP8 weights).

Hidden-state convention (SGLang's and vLLM's DeepSeek/GLM MTP): h_j is the target's FINAL-NORMED
last hidden state at position j (what the lm_head reads). The MTP row at position j (RoPE
position j) takes x_j = eh_proj([enorm(embed(t_{j+1})), hnorm(h_j)]), runs the decoder layer over
its own KV (the `mtp_kv` / `mtp_index_k` pools, over the target's page ids), and its output
h'_j = shared_head.norm(layer(x_j)) proposes t_{j+2} = argmax(head(h'_j)). A chained step k feeds
(proposal_k, h'_{previous row}) at the next position, so h' takes h's place.

Decode (`ModelRunner.spec_step` with this draft): the runner keeps, per request (`DraftBlock.key`), what the last
verify saw: its start position, its tokens and the target's final-normed hidden rows. A step
first runs the MTP over the positions the last verify committed (inputs: the committed token
after each, the TARGET's hidden rows), which writes the MTP KV of those positions and gives the
first proposal; then num_steps − 1 chained rows; then the target verifies [last, d_1..d_n] and
its hidden rows are kept for the next step. KV the chain writes at speculative positions lies in
the request's own pages and is overwritten by the next step's catch-up. On a request's first
decode step the runner holds nothing for it; its block then carries `seed_hidden`, the target's
final-normed hidden row at the prompt's last position that prefill sent in the metadata row,
and the catch-up is that one row (position P − 1, next token the first token): it drafts at
once. Without a seed (prefill did not send the draft KV) it drafts nothing that step and
verifies [last] alone. Without the prompt's MTP KV (`ctx_start` > 0) the MTP's attention hides
the positions below ctx_start (`ForwardBatch.ctx_start`).
The proposals only decide what is verified; the committed output is the target's (greedy equal
to non-speculative decoding, sampled lossless through spec.accept with q).

Prefill (`write_prompt`): the last stage runs the MTP over the prompt rows after the target
forward, with the next prompt token at each row; a chunk's last row takes the target's argmax as
its next token (the greedy first token at the prompt's end; a non-final chunk's next prompt token
is not in it, so that one row may be off: only the draft's context, never the output).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from glm53.kernels.norm import rms_norm
from glm53.kernels.rope import rope_cos_sin, rope_inv_freq
from glm53.models.config import FULL, ConfigError, GlmConfig
from glm53.models.draft import DFlashDraft
from glm53.models.dspark import BlockSampling, draft_probs, inverse_cdf
from glm53.models.kv_cache import INDEX_K, LATENT, KVPools, Pool
from glm53.models.layers import Linear, Norm, ParallelLMHead, VocabParallelEmbedding
from glm53.models.model import DecoderLayer, ForwardBatch
from glm53.models.parallel import TPGroup

MTP_KV = "mtp_kv"  # the MTP layer's latent rows [c_kv | k_pe]
MTP_INDEX_K = "mtp_index_k"  # its indexer keys
MTP_POOLS = (MTP_KV, MTP_INDEX_K)
DEFAULT_NUM_STEPS = 3


@dataclass(frozen=True)
class NextNSpec:
    """What the checkpoint's tensor names say about its MTP layer (`nextn_spec`)."""

    layer: int  # its index, = num_hidden_layers
    moe: bool  # mlp.experts.* (else a dense MLP)
    own_head: bool  # shared_head.head.weight present
    own_embed: bool  # embed_tokens.weight present
    fp8: bool  # some of its weights are block-FP8


def nextn_spec(cfg: GlmConfig, names) -> NextNSpec:
    """The MTP layer of a checkpoint with tensor `names`, or a `ConfigError` naming what is
    missing (num_nextn_predict_layers 0, or the layer's tensors absent)."""
    names = set(names)
    L = cfg.num_hidden_layers
    if cfg.num_nextn_predict_layers < 1:
        raise ConfigError(f"num_nextn_predict_layers: {cfg.num_nextn_predict_layers} (the checkpoint has no MTP "
                          f"layer; NEXTN needs one)")
    p = f"model.layers.{L}."
    need = [p + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                            "input_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight")]
    missing = [n for n in need if n not in names]
    if missing:
        raise ConfigError(f"num_nextn_predict_layers: {cfg.num_nextn_predict_layers}, but the MTP layer's tensors "
                          f"are missing: {', '.join(missing)}")
    if not any(n.startswith(p + "self_attn.indexer.") for n in names):
        raise ConfigError(f"model.layers.{L}.self_attn.indexer: the MTP layer has no DSA indexer weights "
                          f"(it runs its own indexer)")
    return NextNSpec(L, moe=any(n.startswith(p + "mlp.experts.") for n in names),
                     own_head=p + "shared_head.head.weight" in names, own_embed=p + "embed_tokens.weight" in names,
                     fp8=any(n.startswith(p) and n.endswith("weight_scale_inv") for n in names))


def layer_config(cfg: GlmConfig, moe: bool) -> GlmConfig:
    """`cfg` with the MTP layer's entries appended to its schedules (a full indexer layer, MoE or
    dense), so the target's `DecoderLayer` builds it under its own index."""
    return dataclasses.replace(cfg, indexer_types=tuple(cfg.indexer_types) + (FULL,),
                               mlp_layer_types=tuple(cfg.mlp_layer_types) + ("sparse" if moe else "dense",))


class SharedHead(nn.Module):
    def __init__(self, cfg: GlmConfig, dtype: torch.dtype, tp: TPGroup, own_head: bool):
        super().__init__()
        self.norm = Norm(cfg.hidden_size, dtype)
        self.head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, dtype, tp) if own_head else None


class MTPLayer(DecoderLayer):
    """`model.layers.L.*`: the target's decoder layer (built under index L with a full indexer)
    plus the NextN parts; parameter names are the checkpoint's."""

    def __init__(self, cfg: GlmConfig, spec: NextNSpec, dtype: torch.dtype, tp: TPGroup, ep: int = 1,
                 embed: bool = False):
        super().__init__(layer_config(cfg, spec.moe), spec.layer, dtype, tp, ep)
        self.enorm = Norm(cfg.hidden_size, dtype)
        self.hnorm = Norm(cfg.hidden_size, dtype)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, dtype)
        self.shared_head = SharedHead(cfg, dtype, tp, spec.own_head)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp) if embed else None


class NextNDraft(nn.Module):
    """The MTP draft on one rank (its TP shard: the decoder layer splits as the target's, the
    norms and eh_proj are replicated). Parameter names are the checkpoint's
    (`model.layers.L.eh_proj.weight`, ...); `layer` is that module."""

    def __init__(self, cfg: GlmConfig, spec: NextNSpec, dtype: torch.dtype = torch.float32,
                 tp: TPGroup | None = None, ep: int = 1, embed: bool = False, num_steps: int = DEFAULT_NUM_STEPS):
        super().__init__()
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.cfg, self.spec, self.dtype = cfg, spec, dtype
        self.tp = tp if tp is not None else TPGroup.single()
        self.num_steps = num_steps
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(spec.layer): MTPLayer(cfg, spec, dtype, self.tp, ep,
                                                                     embed=embed or spec.own_embed)})
        self.register_buffer("inv_freq", rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta), persistent=False)
        self._target: tuple = ()  # (embed, lm_head) of the target, bound by `bind` (not submodules)
        self.kv: KVPools | None = None
        # Per request key: (start_pos, verify tokens, the target's final-normed hidden rows).
        self.state: dict[int, tuple[int, list[int], torch.Tensor]] = {}

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[str(self.spec.layer)]

    def checkpoint_name(self, param: str) -> str:
        """The checkpoint tensor parameter `param` loads from: its own name, except the layer's
        embedding when the checkpoint has none for it (then the target's `model.embed_tokens`)."""
        if param == f"model.layers.{self.spec.layer}.embed_tokens.weight" and not self.spec.own_embed:
            return "model.embed_tokens.weight"
        return param

    @property
    def block_size(self) -> int:
        """Tokens a verify checks: the num_steps proposals and the bonus slot."""
        return self.num_steps + 1

    def bind(self, embed: nn.Module | None, lm_head: nn.Module | None) -> None:
        """The target's embedding and lm_head, used where the MTP layer has none of its own."""
        self._target = (embed, lm_head)

    def init_buffers(self, device: torch.device | str) -> None:
        device = torch.device(device)
        self.inv_freq = rope_inv_freq(self.cfg.qk_rope_head_dim, self.cfg.rope_theta).to(device)
        ind = self.layer.self_attn.indexer
        if ind is not None:
            ind.init_buffers(device)

    # --- pools ---
    def add_pools(self, pools: KVPools) -> tuple[Pool, Pool]:
        """Adds `mtp_kv` (latent rows) and `mtp_index_k` (indexer keys) of layer L to `pools`, in
        the model dtype (same page ids as the target's pools), and keeps a view of them under
        the names the decoder layer addresses."""
        L, cfg = self.spec.layer, self.cfg
        a = pools.add(MTP_KV, (L,), (cfg.latent_dim,), self.dtype)
        b = pools.add(MTP_INDEX_K, (L,), (cfg.index_head_dim,), self.dtype)
        self.kv = KVPools(pools.num_pages, pools.page_size, pools.device)
        self.kv.attach(LATENT, a)
        self.kv.attach(INDEX_K, b)
        return a, b

    @staticmethod
    def kv_bytes_per_token(cfg: GlmConfig, dtype: torch.dtype) -> int:
        return (cfg.latent_dim + cfg.index_head_dim) * torch.empty((), dtype=dtype).element_size()

    # --- the step formulas ---
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.layer.embed_tokens if self.layer.embed_tokens is not None else self._target[0]
        if e is None:
            raise ValueError("the MTP layer needs an embedding: its own or the target's (bind)")
        return e(ids)

    def head_logits(self, hn: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed MTP rows."""
        head = self.layer.shared_head.head if self.layer.shared_head.head is not None else self._target[1]
        if head is None:
            raise ValueError("the MTP layer needs an output head: shared_head.head or the target's lm_head (bind)")
        return head(hn).float()

    @torch.inference_mode()
    def rows(self, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """h'_j = shared_head.norm(layer(eh_proj([enorm(embed(t_{j+1})), hnorm(h_j)]))) for the
        rows of `batch` (positions j, slots, page tables), writing their MTP KV. `next_ids` [N]
        the tokens t_{j+1}, `hidden` [N, H] h_j. Returns [N, H] in the model dtype."""
        if self.kv is None:
            raise ValueError("the MTP pools are not allocated (add_pools)")
        eps, m = self.cfg.rms_norm_eps, self.layer
        e = rms_norm(self.embed(next_ids).to(self.dtype), m.enorm.weight, eps)
        h = rms_norm(hidden.to(self.dtype), m.hnorm.weight, eps)
        x = m.eh_proj(torch.cat([e, h], dim=-1))
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq)
        x, _ = DecoderLayer.forward(m, x, cos, sin, batch, self.kv, None)
        return rms_norm(x, m.shared_head.norm.weight, eps)

    # --- prefill ---
    @torch.inference_mode()
    def write_prompt(self, batch: ForwardBatch, hidden_normed: torch.Tensor, logits_last: torch.Tensor,
                     last_rows: torch.Tensor) -> None:
        """The MTP KV of every row of a prefill batch: row i's next token is row i + 1's input,
        except at each chunk's last row (`last_rows`), where it is the target's argmax
        (`logits_last`, one row per chunk)."""
        nxt = torch.roll(batch.input_ids, -1)
        nxt[last_rows] = logits_last.argmax(dim=-1)
        self.rows(nxt, hidden_normed, batch)

    # --- decode ---
    def catch_up(self, blocks) -> list[tuple[int, list[int], torch.Tensor] | None]:
        """Per block, the (positions start, next tokens, target hidden rows) of the positions the
        previous verify committed, from the kept state; None when nothing usable is kept."""
        out = []
        for b in blocks:
            st = self.state.get(b.key) if b.key is not None and b.key >= 0 else None
            if st is None and b.seed_hidden is not None and b.start_pos >= 1:
                # The first decode step: prefill's hidden row of the prompt's last position
                # drives the catch-up row there (with the first token as its next token).
                h = b.seed_hidden.reshape(1, -1).to(device=self.inv_freq.device, dtype=self.dtype)
                out.append((b.start_pos - 1, [b.last_token], h))
                continue
            if st is None:
                out.append(None)
                continue
            pos0, toks, hid = st
            a = b.start_pos - pos0 - 1  # drafts the last verify accepted
            if not 0 <= a < len(toks):
                out.append(None)
                continue
            out.append((pos0, list(toks[1:a + 1]) + [b.last_token], hid[: a + 1]))
        return out

    def sampled_proposal(self, logits: torch.Tensor, s: BlockSampling | None, k: int):
        """Step k's proposals [R] (argmax, or for sampled rows a draw from q with uniform k) and q."""
        tok = logits.argmax(dim=-1)
        if s is None:
            return tok, None
        q = draft_probs(logits[:, None], s)[:, 0]
        return torch.where(s.rows, inverse_cdf(q, s.uniforms[:, k]), tok), q

def block_sampling(blocks, n: int, device: torch.device) -> BlockSampling | None:
    """The sampled blocks' uniforms and filters for n chained proposals (DFlash's rule)."""
    return DFlashDraft.block_sampling(blocks, n, device)
