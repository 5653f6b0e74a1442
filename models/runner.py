"""ModelRunner: one pipeline stage of the target model (all layers by default), its named KV
pools, an optional draft model (last stage only), and forwards over sequence chunks (chunked
prefill, decode and verify are all `SeqChunk`s).

A chunk's new tokens start at `start_pos` (tokens already in the cache) and are written into the
request's pages; `page_table` must cover `start_pos + len(token_ids)` tokens. Page allocation is
the caller's (the instance scheduler owns a `PageAllocator` over `pools.num_pages`), so a decode
instance can preallocate pages a prefill instance fills.

Under tensor parallelism every rank holds a runner over its shard of the model (`tp` passed to
`from_dir`, or a model built with it) and its own pools, which are the same as a single rank's
(the latent and indexer caches are replicated). The scheduler sends every rank the same chunks,
in the same order; each rank returns the same full logits.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from glm53.models.config import GlmConfig
from glm53.models.kv_cache import KVPools, kv_bytes_per_token, target_pools
from glm53.models.model import ForwardBatch, GlmForCausalLM, StageInput, StageOutput
from glm53.models.parallel import TPGroup
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
        draft: nn.Module | None = None,
    ):
        if draft is not None and not model.is_last:
            raise ValueError(
                f"a draft model runs on the last stage only; this stage holds layers {model.layer_range}"
            )
        self.cfg: GlmConfig = model.cfg
        self.model = model
        self.draft = draft
        self.device = torch.device(device)
        self.tp: TPGroup = model.tp
        self.pools: KVPools = target_pools(
            model.cfg, model.layer_range, num_pages, page_size, model.dtype, self.device
        )

    @staticmethod
    def kv_bytes_per_token(cfg: GlmConfig, dtype: torch.dtype, layers: range | None = None) -> int:
        """KV bytes one token costs in the target pools of the stage holding `layers`."""
        return kv_bytes_per_token(cfg, dtype, layers)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        page_size: int = 16,
        num_pages: int = 1024,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        layers: range | None = None,
        progress: bool = True,
        tp: TPGroup | None = None,
    ) -> "ModelRunner":
        """Loads the stage holding `layers` (the whole model by default) from a checkpoint; with
        `tp`, this rank's shard of it (reading only its slices of the split tensors)."""
        cfg = GlmConfig.from_dir(model_dir)
        if dtype is None:
            dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
        model = GlmForCausalLM(cfg, dtype=dtype, layers=layers, tp=tp)
        load_weights(model, model_dir, progress=progress)
        model.to(device)
        return cls(model, num_pages=num_pages, page_size=page_size, device=device)

    @property
    def page_size(self) -> int:
        return self.pools.page_size

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @staticmethod
    def logit_rows(chunks: list[SeqChunk]) -> list[int]:
        """Rows of the flattened batch that get logits: every new token of an `all_logits`
        chunk, else its last one."""
        rows, n = [], 0
        for c in chunks:
            k = len(c.token_ids)
            rows.extend(range(n, n + k) if c.all_logits else [n + k - 1])
            n += k
        return rows

    def build_batch(self, chunks: list[SeqChunk]) -> tuple[ForwardBatch, torch.Tensor]:
        ps = self.page_size
        ids, pos, slots, rows = [], [], [], []
        max_pages = max(len(c.page_table) for c in chunks)
        table = torch.full((len(chunks), max(1, max_pages)), -1, dtype=torch.int32)
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
        return batch, torch.tensor(self.logit_rows(chunks), dtype=torch.long, device=dev)

    def forward_stage(
        self, chunks: list[SeqChunk], inputs: StageInput | None = None, capture: Sequence[int] = ()
    ) -> StageOutput:
        """Runs this stage on every chunk in one batch. `inputs` is the previous stage's output
        for the same chunks (None on the first stage); `capture` as `GlmForCausalLM.forward_stage`."""
        batch, _ = self.build_batch(chunks)
        return self.model.forward_stage(batch, self.pools, inputs, capture)

    def forward(self, chunks: list[SeqChunk], inputs: StageInput | None = None) -> list[torch.Tensor]:
        """Last stage: runs every chunk in one batch; per chunk, logits [rows, vocab] fp32."""
        if not self.model.is_last:
            raise ValueError(f"logits come from the last stage; this stage holds layers {self.model.layer_range}")
        out = self.forward_stage(chunks, inputs)
        rows = torch.tensor(self.logit_rows(chunks), dtype=torch.long, device=self.device)
        logits = self.model.logits(out.hidden[rows])
        res, r = [], 0
        for c in chunks:
            k = len(c.token_ids) if c.all_logits else 1
            res.append(logits[r : r + k])
            r += k
        return res
