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

With a DFlash draft (last stage), the runner adds the `draft_kv` pool and every forward over
chunks — chunked prefill and verify alike — also captures the target's feature layers, projects
them and writes the draft context KV of every chunk token at its slot. Drafting reads only
positions below a request's committed length, so the KV a verify writes for positions that are
then rejected is never read, and is overwritten once those positions are committed. A non-last
stage that owns feature layers takes a `DraftProjection` and hands its partial sum on in
`StageOutput.draft_acc`.

With `graphs` (a whole model on one CUDA rank), decode batches of one-token chunks replay CUDA
graphs over a device-resident batch state (models/graph.py, decode_state.py), or, with a draft,
DFlash steps (`spec_step`) replay graphs of propose + verify (models/spec_graph.py,
spec_state.py), or, with the MTP draft, graphs of its chained step (models/mtp_graph.py,
mtp_state.py), and a prompt chunk of one request up to `GraphConfig.prefill_tokens` tokens
replays a prefill graph (models/prefill_graph.py); everything else runs eagerly through
`build_batch`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from glm53.models.config import GlmConfig
from glm53.models.draft import DFlashDraft, DraftBlock
from glm53.models.draft_projection import DraftProjection
from glm53.models.draft_weights import build_draft, cpu_bf16_drafting, load_draft_projection
from glm53.models.fused import fuse_projections_
from glm53.models.dspark import BlockChoice
from glm53.models.graph import DecodeGraphs, GraphConfig
from glm53.models.readback import readback
from glm53.models.prefill_graph import PrefillGraphs
from glm53.models.spec_graph import SpecGraphs
from glm53.models.spec_state import SpecOutput
from glm53.models.kv_cache import KVPools, kv_bytes_per_token, target_pools
from glm53.models.mtp import NextNDraft, block_sampling
from glm53.models.mtp_graph import MTPGraphs
from glm53.models.mtp_weights import build_nextn
from glm53.models.overlap import side_stream
from glm53.models.model import ForwardBatch, GlmForCausalLM, StageInput, StageOutput
from glm53.models.parallel import TPGroup
from glm53.models.weights import load_model

log = logging.getLogger(__name__)


@dataclass
class SeqChunk:
    token_ids: list[int]
    start_pos: int
    page_table: list[int]
    all_logits: bool = False  # True: logits for every new token (verify); else the last one only


def device_longs(values: list, device: torch.device) -> torch.Tensor:
    """Host ints as a long tensor on `device` through a pinned non-blocking copy: a plain
    `torch.tensor(..., device=cuda)` waits for the GPU to drain (a host sync)."""
    t = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


@dataclass
class DeviceTokens:
    """Input tokens that are still on the device (an overlapped decode step's inputs are the
    previous step's samples, not yet read back): chunk `dst[i]`'s one token is `values[src[i]]`;
    its `token_ids` holds a placeholder."""

    values: torch.Tensor  # [m] long, on the runner's device
    src: list[int]
    dst: list[int]

    def __post_init__(self):
        if len(self.src) != len(self.dst):
            raise ValueError("src and dst must have the same length")

    def index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) as device tensors, through one pinned non-blocking copy (no host sync)."""
        t = device_longs([self.src, self.dst], device)
        return t[0], t[1]

    def covers(self, n: int) -> bool:
        """Whether every one of rows [0, n) takes its token from the device."""
        return set(self.dst) >= set(range(n))

    def put(self, input_ids: torch.Tensor) -> None:
        """input_ids[dst[i]] = values[src[i]], on the device. An unchanged batch's steady state
        (src and dst both runs of consecutive rows) is one slice copy; otherwise the indices travel
        in one pinned copy and the rows move by one index copy (two more operations a step)."""
        if not self.dst:
            return
        k, s0, d0 = len(self.src), self.src[0], self.dst[0]
        if self.src == list(range(s0, s0 + k)) and self.dst == list(range(d0, d0 + k)):
            input_ids[d0 : d0 + k].copy_(self.values[s0 : s0 + k])
            return
        src, dst = self.index(input_ids.device)
        input_ids.index_copy_(0, dst, self.values.index_select(0, src))


class ChunkLogits(list):
    """`ModelRunner.forward`'s per-chunk logits; with the MTP draft also `last_hidden`
    [chunks, H]: the target's final-normed hidden row at each chunk's last token (model dtype),
    what prefill sends decode at a prompt's end so that decode drafts at its first step."""

    last_hidden: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        model: GlmForCausalLM,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        draft: DFlashDraft | None = None,
        draft_projection: DraftProjection | None = None,
        graphs: GraphConfig | None = None,
        kv_dtype: torch.dtype | None = None,
        mtp: NextNDraft | None = None,
    ):
        """`mtp`: GLM-5's own MTP layer as the draft (models/mtp.py; last stage; its pools are
        added, every prompt forward writes its KV, and `spec_step` runs its chained step, from
        CUDA graphs with `graphs`).
        `graphs`: capture CUDA graphs of the decode step (models/graph.py) and of short prompt
        chunks (`prefill_tokens`, models/prefill_graph.py); the pools then
        get one more page than `num_pages`, the padding page that padded graph rows write, which
        no page allocator over `num_pages` ever hands out. `kv_dtype`: the target KV cache's
        dtype, the model's (None) or `kv_cache.FP8` (the FP8 layouts; the draft's KV keeps the
        model dtype)."""
        if draft is not None and not model.is_last:
            raise ValueError(
                f"a draft model runs on the last stage only; this stage holds layers {model.layer_range}"
            )
        if draft_projection is not None and (model.is_last or draft is not None):
            raise ValueError("a draft projection is for non-last stages; the last stage takes the draft itself")
        self.cfg: GlmConfig = model.cfg
        self.model = model
        self.draft = draft
        # Projections that share an input become one product each (models/fused), before any
        # graph is captured: fewer launches a layer, one activation quantization under FP8.
        for m in (model, draft, mtp):
            if m is not None:
                fuse_projections_(m)
        self.device = torch.device(device)
        model.side_stream = side_stream(self.device)  # before any graph is captured
        self.tp: TPGroup = model.tp
        self.pools: KVPools = target_pools(
            model.cfg, model.layer_range, num_pages + (graphs is not None), page_size, model.dtype, self.device,
            kv_dtype=kv_dtype,
        )
        # What projects this stage's draft features: the draft itself on the last stage.
        self.projection: DFlashDraft | DraftProjection | None = draft if draft is not None else draft_projection
        self.draft_ids: tuple[int, ...] = ()  # feature layers this stage captures
        self.upstream_ids: tuple[int, ...] = ()  # feature layers of earlier stages
        if self.projection is not None:
            ids = draft.cfg.target_layer_ids if draft is not None else draft_projection.ids
            r = model.layer_range
            self.draft_ids = tuple(i for i in ids if i in r)
            self.upstream_ids = tuple(i for i in ids if i < r.start)
            if draft_projection is not None and set(draft_projection.ids) - set(r):
                raise ValueError(f"draft projection ids {list(draft_projection.ids)} are not all within layers {r}")
        if draft is not None:
            draft.add_pools(self.pools)
        self.mtp = mtp
        if mtp is not None:
            if draft is not None or draft_projection is not None or not model.is_last:
                raise ValueError("the MTP draft runs alone, on the last stage")
            mtp.add_pools(self.pools)
            mtp.bind(model.model.embed_tokens if model.is_first else None, model.lm_head)
        self.graphs: DecodeGraphs | None = None
        self.spec_graphs: SpecGraphs | None = None
        self.mtp_graphs: MTPGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        decode = graphs is not None and graphs.max_bs > 0
        if decode and mtp is not None:
            self.mtp_graphs = MTPGraphs(self, graphs, pad_page=num_pages)
        elif decode and draft is not None:
            self.spec_graphs = SpecGraphs(self, graphs, pad_page=num_pages)
        elif decode:
            self.graphs = DecodeGraphs(self, graphs, pad_page=num_pages)
        if graphs is not None and graphs.prefill_tokens and mtp is None:
            self.prefill_graphs = PrefillGraphs(self, graphs.prefill_tokens, graphs.max_context, pad_page=num_pages)

    @staticmethod
    def kv_bytes_per_token(
        cfg: GlmConfig, dtype: torch.dtype, layers: range | None = None, kv_dtype: torch.dtype | None = None
    ) -> int:
        """KV bytes one token costs in the target pools of the stage holding `layers`."""
        return kv_bytes_per_token(cfg, dtype, layers, kv_dtype)

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
        draft_dir: str | Path | None = None,
        kv_dtype: torch.dtype | None = None,
        fp8: bool = False,
        confidence_threshold: float = 0.0,
        nextn_steps: int | None = None,
        draft_cpu_bf16: bool | None = None,
    ) -> "ModelRunner":
        """Loads the stage holding `layers` (the whole model by default) from a checkpoint, straight
        onto `device` (`weights.load_model`); with `tp`, this rank's shard of it (reading only its
        slices of the split tensors). `fp8`: keep a block-FP8 checkpoint's FP8 weights e4m3 with
        their scales (the rest in `dtype`); by default they are dequantised to `dtype`. With
        `draft_dir`, also the DFlash or DSpark draft there (its config checked against the target's;
        same dtype and `tp`; a DSpark draft cuts at `confidence_threshold`), on the last stage;
        a non-last stage gets its `DraftProjection`. `draft_cpu_bf16`: `DFlashDraft.cpu_bf16` (None: `cpu_bf16_drafting`'s rule). `nextn_steps`: the checkpoint's own MTP layer
        as the draft, chaining that many proposals per verify (last stage)."""
        cfg = GlmConfig.from_dir(model_dir)
        if dtype is None:
            dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
        model = load_model(model_dir, dtype=dtype, device=device, layers=layers, tp=tp, fp8=fp8, progress=progress)
        draft = projection = None
        if draft_dir is not None and model.is_last:
            if draft_cpu_bf16 is None:
                draft_cpu_bf16 = cpu_bf16_drafting(device, dtype, model.tp.size)
            draft = build_draft(draft_dir, cfg, dtype=dtype, tp=model.tp, confidence_threshold=confidence_threshold,
                                cpu_bf16=draft_cpu_bf16)
            draft.to(device)
        elif draft_dir is not None:
            projection = load_draft_projection(draft_dir, cfg, model.layer_range, dtype).to(device)
        mtp = None
        if nextn_steps is not None and model.is_last:
            mtp = build_nextn(model_dir, cfg, dtype=dtype, device=device, tp=model.tp, fp8=fp8,
                              embed=not model.is_first, num_steps=nextn_steps)
        return cls(
            model, num_pages=num_pages, page_size=page_size, device=device, draft=draft, draft_projection=projection,
            kv_dtype=kv_dtype, mtp=mtp,
        )

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
        # width a multiple of 16: the kernels see one class of its row stride (kernels/variants.py)
        table = torch.full((len(chunks), -(-max(1, max_pages) // 16) * 16), -1, dtype=torch.int32)
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
        # One pinned host tensor, one non-blocking copy: a plain torch.tensor(..., device=cuda)
        # is a blocking copy, which waits for the GPU to drain (a host sync per tensor).
        host = torch.tensor([ids, pos, slots, rows], dtype=torch.long, pin_memory=dev.type == "cuda")
        if dev.type == "cuda":
            table = table.pin_memory()
        host, table = (t.to(dev, non_blocking=True) for t in (host, table))
        positions = host[1]
        batch = ForwardBatch(
            input_ids=host[0],
            positions=positions,
            out_slots=host[2],
            page_table=table[host[3]],
            context_lens=(positions + 1).to(torch.int32),
            max_context=max(pos) + 1,
        )
        return batch, self._device_rows(self.logit_rows(chunks))

    def _device_rows(self, rows: list[int]) -> torch.Tensor:
        return device_longs(rows, self.device)

    def forward_stage(
        self, chunks: list[SeqChunk], inputs: StageInput | None = None, capture: Sequence[int] = ()
    ) -> StageOutput:
        """Runs this stage on every chunk in one batch. `inputs` is the previous stage's output
        for the same chunks (None on the first stage); `capture` as `GlmForCausalLM.forward_stage`.
        With a draft, also writes the chunk tokens' draft context KV (last stage) or returns the
        partial projection in `draft_acc` (a non-last stage with a `DraftProjection`)."""
        return self.forward_batch(self.build_batch(chunks)[0], inputs, capture)

    def forward_batch(
        self, batch: ForwardBatch, inputs: StageInput | None = None, capture: Sequence[int] = ()
    ) -> StageOutput:
        """`forward_stage` on a batch already built (device tensors only: the DFlash graphs
        capture it on their static batch)."""
        if self.mtp is not None:
            out = self.model.forward_stage(batch, self.pools, inputs, capture)
            self._write_mtp(batch, out)
            return out
        if self.projection is None:
            return self.model.forward_stage(batch, self.pools, inputs, capture)
        out = self.model.forward_stage(batch, self.pools, inputs, tuple(set(capture) | set(self.draft_ids)))
        acc = inputs.draft_acc if inputs is not None else None
        if acc is None and self.upstream_ids:
            raise ValueError(
                f"draft feature layers {list(self.upstream_ids)} belong to earlier stages: this stage needs their "
                "partial projection (StageInput.draft_acc)"
            )
        features = {i: out.captures[i] for i in self.draft_ids}
        if acc is None and not features:
            acc = torch.zeros(len(batch.positions), self.cfg.hidden_size, dtype=torch.float32, device=self.device)
        out.captures = {i: out.captures[i] for i in capture}
        if self.draft is None:
            out.draft_acc = self.projection.partial_projection(features, acc) if features else acc
        else:
            c = self.draft.context_of(features, acc) if features else self.draft.context(acc)
            self.draft.write_context(c, batch.positions, batch.out_slots, self.pools)
        return out

    def _write_mtp(self, batch: ForwardBatch, out: StageOutput) -> None:
        """The MTP KV of a forward's rows (prompt chunks): each chunk's last row is where the
        next row's position does not follow or its page table differs."""
        pos, table = batch.positions, batch.page_table
        last = torch.ones_like(pos, dtype=torch.bool)
        if len(pos) > 1:
            last[:-1] = (pos[1:] != pos[:-1] + 1) | (table[1:] != table[:-1]).any(dim=1)
        rows = last.nonzero().squeeze(1)
        hn = self.model.normed_hidden(out)
        self.mtp.write_prompt(batch, hn, self.model.head(hn[rows]), rows)

    def propose(self, blocks: list[DraftBlock], return_logits: bool = False):
        """The draft's proposals [R, B − 1] for `blocks` (see `DFlashDraft.propose`); needs a
        draft and the whole target model (its embedding and lm_head)."""
        if self.draft is None:
            raise ValueError("this runner holds no draft model")
        return self.draft.propose(self.model, blocks, self.pools, return_logits=return_logits)

    def draft_block(self, blocks: list[DraftBlock]) -> BlockChoice:
        """The draft's proposals for `blocks` of one block size, as `DFlashDraft.draft_block`
        chooses them (argmax or sampled, DSpark's confidence cut in `keep`)."""
        if self.draft is None:
            raise ValueError("this runner holds no draft model")
        return self.draft.draft_block(self.model, blocks, self.pools)[0]

    def spec_step(self, blocks: list[DraftBlock]) -> SpecOutput:
        """One speculative step for a batch: the draft proposes up to `block_size − 1` tokens per
        request (none for a block of 1; DSpark's confidence cut may keep fewer), then one target
        forward verifies `[last token, drafts...]` and writes the draft context of every verified
        position. A captured graph runs it when one holds the batch (`SpecGraphs.bucket`
        decides), else it runs eagerly. Every TP rank computes the same proposals (sampled ones
        from the blocks' seeds), so every rank builds the same verify batch."""
        if self.mtp is not None:
            hit = self.mtp_graphs.bucket(blocks) if self.mtp_graphs is not None else None
            return self.mtp_graphs.step(blocks, *hit) if hit is not None else self._mtp_step(blocks)
        if self.spec_graphs is not None:
            hit = self.spec_graphs.bucket(blocks)
            if hit is not None:
                return self.spec_graphs.step(*hit)
        drafts: list[list[int]] = [[] for _ in blocks]
        probs: list[torch.Tensor | None] = [None] * len(blocks)
        for size in {b.block_size for b in blocks} - {1}:  # one propose call per block size
            idx = [i for i, b in enumerate(blocks) if b.block_size == size]
            choice = self.draft_block([blocks[i] for i in idx])
            rows, keeps = readback(choice.tokens).tolist(), readback(choice.keep).tolist()
            for j, (i, row, keep) in enumerate(zip(idx, rows, keeps)):
                drafts[i] = row[:keep]
                if blocks[i].sampling is not None:
                    probs[i] = choice.probs[j, :keep]
        chunks = [SeqChunk([b.last_token, *d], b.start_pos, b.page_table, all_logits=True)
                  for b, d in zip(blocks, drafts)]
        logits = self.forward(chunks)
        # Every row's argmax in one copy (greedy requests accept from it without a read each).
        flat = readback((logits[0] if len(logits) == 1 else torch.cat(logits)).argmax(dim=-1)).tolist()
        greedy, r = [], 0
        for lg in logits:
            greedy.append(flat[r : r + len(lg)])
            r += len(lg)
        return SpecOutput(drafts, logits, greedy, probs if any(p is not None for p in probs) else None)

    @property
    def spec_overlap(self) -> bool:
        """Whether `spec_launch` can hold a step (DFlash step graphs: the whole model and its draft)."""
        return self.spec_graphs is not None

    @torch.inference_mode()
    def spec_launch(self, blocks: list[DraftBlock]) -> torch.Tensor | None:
        """Launch `spec_step`'s step for `blocks` from the graphs without waiting for it: its
        tokens [len(blocks), 2K] on the device (the drafts, the K verify argmaxes, the verified
        count; valid until the next launch), or None when no graph holds the batch. The state's
        rows then sit at the step after it as greedy acceptance moves them, which `spec_relaunch`
        runs."""
        hit = self.spec_graphs.bucket(blocks) if self.spec_graphs is not None else None
        if hit is None:
            return None
        return self.spec_graphs.launch(*hit)[0][: len(blocks)]

    @torch.inference_mode()
    def spec_relaunch(self, m: int, reach: int) -> torch.Tensor | None:
        """The next step of the last `spec_launch`'s `m` requests, whose inputs never left the
        device; None when no graph's width covers `reach` (the host's bound on the position the
        step's tokens stop before)."""
        out = self.spec_graphs.relaunch(m, reach)
        return None if out is None else out[0][:m]

    @torch.inference_mode()
    def _mtp_step(self, blocks: list[DraftBlock]) -> SpecOutput:
        """The MTP draft's speculative step for `blocks` (the whole target on this runner):
        catch-up rows over what the last verify committed, num_steps − 1 chained rows, then one
        target forward verifying [last token, proposals...]; keeps the verify's hidden rows for
        the next step (only of this batch's requests: a request that left is forgotten)."""
        mtp = self.mtp
        if not blocks:
            raise ValueError("spec_step needs at least one block")
        dev = self.device
        widths = [(b.block_size or mtp.block_size) - 1 for b in blocks]  # proposals wanted
        ups = mtp.catch_up(blocks)
        live = [i for i, u in enumerate(ups) if u is not None and widths[i] > 0]
        drafts: list[list[int]] = [[] for _ in blocks]
        probs: list[torch.Tensor | None] = [None] * len(blocks)
        if live:
            n = max(widths[i] for i in live)
            sampling = block_sampling([blocks[i] for i in live], n, dev)
            # Catch-up: the committed positions, fed by the target's hidden rows.
            chunks = [SeqChunk(ups[i][1], ups[i][0], blocks[i].page_table) for i in live]
            batch, _ = self.build_batch(chunks)
            # Without the prompt's MTP KV (prefill did not send it: ctx_start > 0) the MTP's
            # attention hides those positions. Masking, not recomputing: computing that KV here
            # needs the target's hidden state at every prompt position, i.e. the prompt's whole
            # forward again, while the mask costs one compare per indexer logit; the draft only
            # loses context (fewer accepted), never output, which the target decides.
            masked = any(blocks[i].ctx_start > 0 for i in live)
            ctx = [min(blocks[i].ctx_start, c.start_pos) for i, c in zip(live, chunks)]
            if masked:
                batch.ctx_start = torch.tensor([x for x, c in zip(ctx, chunks) for _ in c.token_ids], device=dev)
            hidden = torch.cat([ups[i][2] for i in live])
            h = mtp.rows(batch.input_ids, hidden, batch)
            ends = torch.tensor([len(ups[i][1]) for i in live]).cumsum(0) - 1
            h = h[ends.to(dev)]
            toks, qs = [], []
            for k in range(n):
                if k:  # a chained row at position start_pos + k − 1: (proposal k, h' before it)
                    chunks = [SeqChunk([0], blocks[i].start_pos + k - 1, blocks[i].page_table) for i in live]
                    batch, _ = self.build_batch(chunks)
                    if masked:
                        batch.ctx_start = torch.tensor(ctx, device=dev)
                    h = mtp.rows(toks[-1], h, batch)
                tok, q = mtp.sampled_proposal(mtp.head_logits(h), sampling, k)
                toks.append(tok)
                qs.append(q)
            rows = readback(torch.stack(toks, dim=1)).tolist()
            for j, i in enumerate(live):
                drafts[i] = rows[j][: widths[i]]
                if blocks[i].sampling is not None:
                    probs[i] = torch.stack(qs, dim=1)[j, : widths[i]]
        # Verify, keeping the target's final-normed rows for the next step's catch-up.
        chunks = [SeqChunk([b.last_token, *d], b.start_pos, b.page_table, all_logits=True)
                  for b, d in zip(blocks, drafts)]
        batch, _ = self.build_batch(chunks)
        out = self.model.forward_stage(batch, self.pools, None)
        hn = self.model.normed_hidden(out)
        flat_logits = self.model.head(hn)
        logits, state, r = [], {}, 0
        for b, c in zip(blocks, chunks):
            k = len(c.token_ids)
            logits.append(flat_logits[r : r + k])
            if b.key is not None and b.key >= 0:
                state[b.key] = (b.start_pos, c.token_ids, hn[r : r + k])
            r += k
        mtp.state = state
        flat = readback(flat_logits.argmax(dim=-1)).tolist()
        greedy, r = [], 0
        for lg in logits:
            greedy.append(flat[r : r + len(lg)])
            r += len(lg)
        return SpecOutput(drafts, logits, greedy, probs if any(p is not None for p in probs) else None)


    def forward(self, chunks: list[SeqChunk], inputs: StageInput | None = None,
                tokens: DeviceTokens | None = None) -> list[torch.Tensor]:
        """Last stage: runs every chunk in one batch; per chunk, logits [rows, vocab] fp32.
        `tokens`: the inputs of some one-token chunks are on the device (whole model only)."""
        if not self.model.is_last:
            raise ValueError(f"logits come from the last stage; this stage holds layers {self.model.layer_range}")
        if tokens is not None:
            self._check_device_tokens(chunks, inputs)
        if self.graphs is not None and inputs is None:
            key = self.graphs.bucket(chunks)
            if key is not None:
                return self.graphs.forward(chunks, key, tokens)
        if self.prefill_graphs is not None and inputs is None and tokens is None:
            key = self.prefill_graphs.bucket(chunks)
            if key is not None:
                return ChunkLogits(self.prefill_graphs.forward(chunks, key))
        if tokens is not None:
            return list(self._forward_with(chunks, tokens).split(1))
        out = self.forward_stage(chunks, inputs)
        if all(c.all_logits for c in chunks):  # every row (verify blocks): no gather
            logits = self.model.head(self.model.normed_hidden(out))
        else:
            logits = self.model.head(self.model.normed_hidden(out, self._device_rows(self.logit_rows(chunks))))
        res, r = ChunkLogits(), 0
        for c in chunks:
            k = len(c.token_ids) if c.all_logits else 1
            res.append(logits[r : r + k])
            r += k
        if self.mtp is not None:  # each chunk's last row, final-normed: the MTP's seed at a prompt's end
            ends = torch.tensor([len(c.token_ids) for c in chunks]).cumsum(0) - 1
            res.last_hidden = self.model.normed_hidden(out, ends.to(self.device))
        return res

    def _check_device_tokens(self, chunks: list[SeqChunk], inputs: StageInput | None = None) -> None:
        if inputs is not None or not (self.model.is_first and self.model.is_last) or self.draft is not None:
            raise ValueError("device-side input tokens are for plain decode on the whole model")
        if any(len(c.token_ids) != 1 or c.all_logits for c in chunks):
            raise ValueError("device-side input tokens are for batches of one-token chunks")

    def decode_rows(self, chunks: list[SeqChunk], tokens: DeviceTokens | None = None) -> torch.Tensor:
        """A plain decode batch's logits [len(chunks), vocab], one row per one-token chunk;
        `tokens`: the inputs of some chunks are on the device. Under a decode graph the rows are
        the graph's own output, in the model's dtype (their widening to fp32 is exact), which its
        next replay overwrites: what reads them (the sampler) must be queued before the next
        forward. That saves the overlapped loop three copies a step (the fp32 cast, `forward`'s
        copy and the caller's stack of its rows); eagerly they are fp32."""
        self._check_device_tokens(chunks)
        if self.graphs is not None:
            key = self.graphs.bucket(chunks)
            if key is not None:
                return self.graphs.run(chunks, key, tokens)
        if tokens is not None:
            return self._forward_with(chunks, tokens)
        return torch.cat(self.forward(chunks))

    def _forward_with(self, chunks: list[SeqChunk], tokens: DeviceTokens) -> torch.Tensor:
        """The eager forward with the device-side tokens put into the batch's input ids (one token
        per chunk: chunk i is row i of the batch): logits [len(chunks), vocab]."""
        batch, _ = self.build_batch(chunks)
        tokens.put(batch.input_ids)
        return self.model.forward(batch, self.pools, slice(None))
