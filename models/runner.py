"""ModelRunner: the model, its page-major KV pools and page allocator, and a forward over
sequence chunks (chunked prefill, decode, verify are all `SeqChunk`s).

A chunk's new tokens start at `start_pos` (tokens already in the cache) and are written into the
request's pages; `page_table` must cover `start_pos + len(token_ids)` tokens. The caller owns page
allocation (`allocator`), so a decode instance can preallocate pages a prefill instance fills.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from glm53.models.config import GlmConfig
from glm53.models.kv_cache import KVPool, KVPoolSpec, PageAllocator
from glm53.models.model import ForwardBatch, GlmForCausalLM
from glm53.models.weights import load_weights

log = logging.getLogger(__name__)


@dataclass
class SeqChunk:
    token_ids: list[int]
    start_pos: int
    page_table: list[int]
    all_logits: bool = False  # True: logits for every new token (verify); else the last one only


class ModelRunner:
    def __init__(
        self,
        model: GlmForCausalLM,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
    ):
        cfg = model.cfg
        self.cfg = cfg
        self.model = model
        self.device = torch.device(device)
        layers = tuple(model.layer_range)
        spec = KVPoolSpec(
            num_pages=num_pages,
            page_size=page_size,
            layers=layers,
            indexer_layers=tuple(i for i in cfg.full_layers if i in layers),
            latent_dim=cfg.latent_dim,
            index_dim=cfg.index_head_dim,
            dtype=model.dtype,
        )
        self.kv = KVPool(spec, device=self.device)
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def kv_bytes_per_token(cfg: GlmConfig, dtype: torch.dtype, layers: range | None = None) -> int:
        """KV bytes one token costs in this stage's pools (latent on every layer, indexer keys
        on full layers only)."""
        layers = layers if layers is not None else range(cfg.num_hidden_layers)
        n_full = sum(1 for i in cfg.full_layers if i in layers)
        elt = torch.empty((), dtype=dtype).element_size()
        return (len(layers) * cfg.latent_dim + n_full * cfg.index_head_dim) * elt

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        page_size: int = 16,
        num_pages: int = 1024,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        progress: bool = True,
    ) -> "ModelRunner":
        cfg = GlmConfig.from_dir(model_dir)
        if dtype is None:
            dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
        model = GlmForCausalLM(cfg, dtype=dtype)
        load_weights(model, model_dir, progress=progress)
        model.to(device)
        return cls(model, num_pages=num_pages, page_size=page_size, device=device)

    @property
    def page_size(self) -> int:
        return self.kv.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def build_batch(self, chunks: list[SeqChunk]) -> tuple[ForwardBatch, torch.Tensor]:
        ps = self.page_size
        ids, pos, slots, rows, logit_rows = [], [], [], [], []
        max_pages = max(len(c.page_table) for c in chunks)
        table = torch.full((len(chunks), max(1, max_pages)), -1, dtype=torch.int32)
        n = 0
        for i, c in enumerate(chunks):
            end = c.start_pos + len(c.token_ids)
            if not c.token_ids:
                raise ValueError("a chunk needs at least one token")
            if end > self.cfg.max_position_embeddings:
                raise ValueError(f"position {end - 1} exceeds max_position_embeddings={self.cfg.max_position_embeddings}")
            if self.pages_needed(end) > len(c.page_table):
                raise ValueError(f"page table of {len(c.page_table)} pages cannot hold {end} tokens (page_size={ps})")
            table[i, : len(c.page_table)] = torch.tensor(c.page_table, dtype=torch.int32)
            p = list(range(c.start_pos, end))
            ids.extend(c.token_ids)
            pos.extend(p)
            slots.extend(c.page_table[q // ps] * ps + q % ps for q in p)
            rows.extend([i] * len(p))
            logit_rows.extend(range(n, n + len(p)) if c.all_logits else [n + len(p) - 1])
            n += len(p)
        dev = self.device
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=positions,
            out_slots=torch.tensor(slots, dtype=torch.long, device=dev),
            page_table=table.to(dev)[torch.tensor(rows, device=dev)],
            context_lens=(positions + 1).to(torch.int32),
            max_context=max(pos) + 1,
        )
        return batch, torch.tensor(logit_rows, dtype=torch.long, device=dev)

    def forward(self, chunks: list[SeqChunk]) -> list[torch.Tensor]:
        """Runs every chunk in one batch; per chunk, logits [rows, vocab] fp32."""
        batch, logit_rows = self.build_batch(chunks)
        logits = self.model(batch, self.kv, logit_rows)
        out, r = [], 0
        for c in chunks:
            k = len(c.token_ids) if c.all_logits else 1
            out.append(logits[r : r + k])
            r += k
        return out
