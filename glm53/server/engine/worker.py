"""One rank of an instance: its device, its model stage, its KV pools and its transfer engine.

An instance runs `tp × pp` ranks. Each is described by a `RankSpec` (plain data, so a rank
process can receive it whole) and built into a `RankWorker`. The scheduler never touches a rank
directly: it drives them through a `WorkerGroup` (group.py), which fans work out and combines
results, so the same scheduler serves one in-process rank and many rank processes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from glm53.models import GlmConfig, ModelRunner, SeqChunk
from glm53.models.draft import DRAFT_KV, DFlashDraft, DraftBlock
from glm53.models.draft_projection import DraftProjection
from glm53.models.mtp import MTP_POOLS, NextNDraft
from glm53.models.mtp_weights import build_nextn
from glm53.models.draft_weights import build_draft, cpu_bf16_drafting, draft_config, load_draft_projection
from glm53.models.graph import GraphConfig
from glm53.models.kv_cache import FP8
from glm53.models.prefill_graph import PREFILL_GRAPH_TOKENS
from glm53.models.spec_state import SpecOutput
from glm53.models.warmup import warm_up
from glm53.models.weights import load_model
from glm53.models.parallel import TPGroup
from glm53.models.runner import DeviceTokens
from glm53.server.config import ClusterConfig, InstanceConfig
from glm53.server.engine.logprobs import meta_slot_bytes
from glm53.server.engine.mtp_seed import seed_bytes
from glm53.server.engine.pipeline import StagePipe, run_microbatches
from glm53.transport import KVReceiver, KVSender, Room, TransferEngine, TransportConfig

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# kv_cache_dtype values that are not the model dtype ("auto" or a DTYPES key are the model's).
KV_DTYPES = {"fp8_e4m3": FP8}
# KV capacity on CPU when neither num_pages nor max_total_tokens is set.
CPU_DEFAULT_KV_TOKENS = 65536


@dataclass(frozen=True)
class RankSpec:
    """Everything one rank needs to build itself."""

    role: str  # "prefill" | "decode"
    instance: str
    model_path: str
    device: str  # "cpu" | "cuda:N"
    dtype: str  # a DTYPES key
    layers: range  # this rank's stage: global layer ids [start, stop)
    page_size: int
    # KV capacity: num_pages, else max_total_tokens, else (GPU) mem_fraction_static of the device.
    num_pages: int | None
    max_total_tokens: int | None
    mem_fraction_static: float
    transport: TransportConfig
    kv_cache_dtype: str = "auto"  # "auto" / the model dtype, or "fp8_e4m3" (the FP8 KV layouts)
    bootstrap_address: str | None = None  # prefill: where the instance's bootstrap server listens
    # A DFlash draft (the last stage runs it; earlier stages project their own features with its
    # `fc` blocks); None: no speculative decoding.
    draft_path: str | None = None
    send_draft_kv: bool = True  # prefill: register the draft KV with the transfer engine (sent to decode)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    ep_size: int = 1  # expert-parallel groups among the stage's tp ranks (models/expert_parallel.py)
    # Decode CUDA graphs (models/graph.py; with a draft, of the DFlash step, models/spec_graph.py):
    # the largest captured batch (0: none) and the longest request a graph holds, in tokens (None:
    # the model's max_position_embeddings).
    cuda_graph_max_bs: int = 0
    context_length: int | None = None
    num_draft_tokens: int | None = None  # the verify width of a DFlash step (None: the draft's block)
    draft_algorithm: str = "DFLASH"  # "DSPARK": the draft must carry a Markov head
    confidence_threshold: float = 0.0  # DSPARK: cut blocks below this confidence (0: never)
    # NEXTN: the checkpoint's own MTP layer drafts this many tokens per verify (last stage); None: off.
    nextn_steps: int | None = None
    # Start-up warm-up (models/warmup.py, GPU only): the most requests' tokens one forward holds
    # (prefill: chunked_prefill_size; decode: max_running_requests, times the verify width with a
    # draft); every Triton variant up to it is compiled before the instance is ready. 0: none.
    warmup_tokens: int = 0
    # Prefill: graphs of one request's prompt chunk up to this many tokens (models/prefill_graph.py;
    # `prefill_graph_tokens` below; server/plan.py reserves their pool). 0: none.
    prefill_graph_tokens: int = 0

    def same_weights(self, other: "RankSpec") -> bool:
        """Whether a rank built from `other` holds exactly this rank's weights (model, dtype,
        device, layers, an unsharded tp, the draft): a colocated pair's ranks then share them.
        (`dtype` decides the FP8 form too: "auto" keeps a block-FP8 checkpoint's weights FP8, an
        explicit dtype dequantizes them, so the two never share.)"""
        keys = ("model_path", "device", "dtype", "layers", "tp_size", "pp_size", "ep_size", "draft_path",
                "nextn_steps")
        return self.tp_size == 1 and all(getattr(self, k) == getattr(other, k) for k in keys)

    @property
    def graphs(self) -> bool:
        """Whether this rank captures decode graphs: decode, CUDA, the whole model (and its draft,
        if any) on one rank."""
        return (self.cuda_graph_max_bs > 0 and self.role == "decode" and self.device.startswith("cuda")
                and self.tp_size == 1 and self.pp_size == 1)

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def stage_layers(num_layers: int, pp_size: int) -> list[range]:
    """Contiguous layer ranges, one per pipeline stage, sizes differing by at most one (earlier
    stages take the extra layers: the last stage also runs the final norm, lm_head and sampling)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp_size must be in [1, {num_layers}] for {num_layers} layers, got {pp_size}")
    base, extra = divmod(num_layers, pp_size)
    out, start = [], 0
    for s in range(pp_size):
        stop = start + base + (1 if s < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


def transport_config(cluster: ClusterConfig, inst: InstanceConfig) -> TransportConfig:
    t = cluster.transfer
    if t.backend != "nixl":
        raise SystemExit(f"{cluster.source}: transfer.backend {t.backend!r} is not available; use 'nixl'")
    return TransportConfig(
        bootstrap_timeout_s=t.bootstrap_timeout_s,
        # Queue waits are the schedulers' (router.max_queue_wait_s; they fail a request as
        # "overloaded" at its deadline and the router aborts the room): the transport's is a backstop.
        queue_timeout_s=cluster.router.max_queue_wait_s + t.bootstrap_timeout_s,
        transfer_timeout_s=t.transfer_timeout_s,
        peer_timeout_s=min(10.0, t.transfer_timeout_s),
        host=inst.host,
        # One metadata slot per receiving request: never fewer than the decode batch can hold.
        meta_slots=max(1024, inst.engine.max_running_requests),
        # The commit record carries the first token of every choice and its logprobs.
        meta_slot_bytes=meta_slot_bytes(),
    )


def rank_specs(cluster: ClusterConfig, inst: InstanceConfig, model_path: str, num_layers: int) -> list[RankSpec]:
    """The instance's ranks, pp-major (stage s holds ranks s*tp .. s*tp + tp - 1), each with its
    stage's layers and, on CUDA, its GPU from `devices` in that order. An instance across nodes
    (server/nodes.py) gives each rank its node's next GPU, and its node's host for the transfer
    endpoints it binds (decode ranks and the bootstrap server learn them from the registration)."""
    eng = inst.engine
    boot = inst.bootstrap_address
    stages = stage_layers(num_layers, inst.pp)
    cfg = transport_config(cluster, inst)
    spec = cluster.speculative
    specs = []
    for pp_rank, layers in enumerate(stages):
        for tp_rank in range(inst.tp):
            k = pp_rank * inst.tp + tp_rank
            gpu = inst.rank_device(k)
            device = "cpu" if eng.device == "cpu" else f"cuda:{k if gpu is None else gpu}"
            specs.append(RankSpec(
                role=inst.role, instance=inst.name, model_path=model_path, device=device, dtype=eng.dtype,
                layers=layers, page_size=eng.page_size, num_pages=eng.num_pages,
                max_total_tokens=eng.max_total_tokens, mem_fraction_static=eng.mem_fraction_static,
                kv_cache_dtype=eng.kv_cache_dtype, transport=dataclasses.replace(cfg, host=inst.rank_node(k).host),
                bootstrap_address=boot, tp_rank=tp_rank, tp_size=inst.tp, pp_rank=pp_rank,
                pp_size=inst.pp, ep_size=inst.ep, send_draft_kv=spec.draft_kv_transfer,
                draft_path=spec.draft_model_path if spec.enabled else None,
                cuda_graph_max_bs=0 if eng.disable_cuda_graph else min(eng.cuda_graph_max_bs, eng.max_running_requests),
                context_length=cluster.model.context_length,
                num_draft_tokens=spec.verify_width if spec.enabled else None,
                draft_algorithm=spec.algorithm, confidence_threshold=spec.dspark_confidence_threshold,
                nextn_steps=spec.nextn_steps if spec.nextn else None,
                warmup_tokens=eng.chunked_prefill_size if inst.role == "prefill" else eng.max_running_requests,
                prefill_graph_tokens=prefill_graph_tokens(cluster, inst)))
    return specs


def prefill_graph_tokens(cluster: ClusterConfig, inst: InstanceConfig) -> int:
    """The longest prompt chunk an instance's prefill graphs hold (models/prefill_graph.py; its
    rank captures them, and its plan reserves their pool, server/plan.py), 0 for none: a prefill
    instance on CUDA holding the whole model on one rank, graphs not disabled, no MTP layer, not
    colocated (a colocated prefill runs eagerly on a green context)."""
    eng, spec = inst.engine, cluster.speculative
    graphs = (inst.role == "prefill" and eng.device != "cpu" and not eng.disable_cuda_graph
              and eng.cuda_graph_max_bs > 0 and inst.tp == inst.pp == 1 and inst.colocate is None
              and not (spec.enabled and spec.nextn))
    return min(PREFILL_GRAPH_TOKENS, eng.chunked_prefill_size) if graphs else 0


def kv_pages(spec: RankSpec, cfg: GlmConfig, dtype: torch.dtype, draft: DFlashDraft | None = None,
             reserved_before: int = 0) -> int:
    """KV capacity in pages: `num_pages`, else `max_total_tokens`, else (GPU) what fits in
    `mem_fraction_static` of the device once the weights are loaded, else (CPU) 64K tokens.
    `reserved_before`: what this process's allocator held before the rank was built (another
    instance in the same process, engine/colocate.py)."""
    if spec.num_pages is not None:
        return spec.num_pages
    tokens = spec.max_total_tokens
    device = torch.device(spec.device)
    if tokens is None and device.type == "cuda":
        # mem_fraction_static is this instance's share of the GPU (instances may share one): count
        # only what this rank holds, not what another instance on the same GPU took.
        _, total = torch.cuda.mem_get_info(device)
        used = torch.cuda.memory_reserved(device) - reserved_before
        budget = total * spec.mem_fraction_static - used
        per_token = ModelRunner.kv_bytes_per_token(cfg, dtype, spec.layers, KV_DTYPES.get(spec.kv_cache_dtype))
        if draft is not None:
            per_token += draft.kv_bytes_per_token()
        if spec.nextn_steps is not None and spec.last_stage:
            per_token += NextNDraft.kv_bytes_per_token(cfg, dtype)
        tokens = int(budget // per_token)
        if tokens < spec.page_size:
            raise SystemExit(f"{spec.instance}: mem_fraction_static={spec.mem_fraction_static} leaves no room for "
                             f"the KV cache after the weights ({used / 2**30:.1f} GiB used of "
                             f"{total / 2**30:.1f})")
    return -(-(tokens or CPU_DEFAULT_KV_TOKENS) // spec.page_size)


class RankWorker:
    """One rank, built in two steps so that a group of ranks can agree on one page count (one
    page-id space per instance): construction loads the stage with its weights and measures
    `capacity()`; `allocate(num_pages)` then creates the named KV pools, registers each by name
    with this rank's transfer engine and starts it (a prefill rank registers with its bootstrap
    server)."""

    def __init__(self, spec: RankSpec, tp_group: dist.ProcessGroup | None = None,
                 weights_from: "RankWorker | None" = None):
        """`tp_group`: the torch.distributed group of this rank's stage (None when tp = 1).
        `weights_from`: a rank in this process whose weights this one shares when they are the
        same (`RankSpec.same_weights`; a colocated pair): one copy on the GPU instead of two. The
        modules are only read by a forward, so both ranks' loops may run them at once."""
        self.spec = spec
        self.device = torch.device(spec.device)
        self.reserved_before = 0
        if self.device.type == "cuda":
            # One GPU per rank process: make it the current one, so work that follows the current
            # device (cuBLAS handles, CUDA graph capture streams) runs on it, not on GPU 0.
            torch.cuda.set_device(self.device)
            self.reserved_before = torch.cuda.memory_reserved(self.device)
        self.cfg = GlmConfig.from_dir(spec.model_path)
        name = self.cfg.torch_dtype if spec.dtype == "auto" else spec.dtype
        self.dtype = DTYPES.get(name, torch.bfloat16)
        self.tp = TPGroup.from_process_group(tp_group) if tp_group is not None else TPGroup.single()
        if self.tp.size != spec.tp_size:
            raise ValueError(f"{spec.instance}: rank built for tp={spec.tp_size} in a group of {self.tp.size}")
        self.draft: DFlashDraft | None = None
        self.projection: DraftProjection | None = None  # a non-last stage's share of the draft's fc
        self.shares_weights = weights_from is not None and weights_from.spec.same_weights(spec)
        self.mtp: NextNDraft | None = None  # NEXTN: the checkpoint's own MTP layer (last stage)
        if self.shares_weights:
            self.model = weights_from.model
            if self.keeps_draft:
                self.draft, self.projection = weights_from.draft, weights_from.projection
            # Its KV state is per runner (pools, per-request rows): the pair shares no MTP module.
            if spec.nextn_steps is not None and spec.last_stage and self.keeps_draft:
                self._load_mtp(spec)
        else:
            self._load(spec)
        self.runner: ModelRunner | None = None
        self.transfer: TransferEngine | None = None

    def _load(self, spec: RankSpec) -> None:
        # Streamed straight onto the device (models/weights.load_model: no host copy of the stage);
        # dtype "auto" keeps a block-FP8 checkpoint's FP8 weights FP8, an explicit dtype dequantizes.
        self.model = load_model(spec.model_path, dtype=self.dtype, device=self.device, layers=spec.layers, tp=self.tp,
                                fp8=spec.dtype == "auto", progress=False, ep=spec.ep_size)
        if not self.keeps_draft:
            return
        if spec.draft_path and spec.last_stage:
            # A draft that does not fit the target is refused here, naming the field.
            cfg = draft_config(spec.draft_path, self.cfg)
            if cfg.algorithm != spec.draft_algorithm:
                raise ValueError(f"speculative.algorithm {spec.draft_algorithm}: {spec.draft_path} is a "
                                 f"{cfg.algorithm} draft" + (" (no markov_head.* tensors)" if cfg.algorithm == "DFLASH"
                                                             else " (use algorithm DSPARK)"))
            if spec.confidence_threshold > 0 and not cfg.confidence_head:
                raise ValueError(f"speculative.dspark_confidence_threshold {spec.confidence_threshold}: "
                                 f"{spec.draft_path} has no confidence head (confidence_head.proj.*)")
            self.draft = build_draft(spec.draft_path, self.cfg, dtype=self.dtype, tp=self.tp,
                                     confidence_threshold=spec.confidence_threshold,
                                     cpu_bf16=cpu_bf16_drafting(self.device, self.dtype, self.tp.size))
            self.draft.to(self.device)
        elif spec.draft_path:
            self.projection = load_draft_projection(spec.draft_path, self.cfg, spec.layers, self.dtype).to(self.device)
        if spec.nextn_steps is not None and spec.last_stage:
            self._load_mtp(spec)

    def _load_mtp(self, spec: RankSpec) -> None:
        self.mtp = build_nextn(spec.model_path, self.cfg, dtype=self.dtype, device=self.device, tp=self.tp,
                               ep=spec.ep_size, fp8=spec.dtype == "auto", embed=spec.layers.start != 0,
                               num_steps=spec.nextn_steps)

    @property
    def keeps_draft(self) -> bool:
        """Whether this rank runs its draft (DFlash / DSpark / MTP) at all: every rank but a prefill
        rank that does not send the draft KV (`draft_kv_transfer: false`), whose draft KV nothing
        would read (decode builds its own); its prompt forwards skip the draft's context KV."""
        return self.spec.role != "prefill" or self.spec.send_draft_kv

    def capacity(self) -> int:
        """KV pages this rank can hold once its weights are loaded."""
        return kv_pages(self.spec, self.cfg, self.dtype, self.draft, self.reserved_before)

    def allocate(self, num_pages: int) -> None:
        spec = self.spec
        graphs = None
        # A graph (and the warm-up) holds the longest request this instance can admit, and no more.
        longest = min(spec.context_length or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings,
                      num_pages * spec.page_size)
        if spec.graphs:
            block = None
            if self.draft is not None:  # a wider ask is the decode scheduler's error, not the capture's
                block = min(spec.num_draft_tokens or self.draft.cfg.block_size, self.draft.cfg.block_size)
            graphs = GraphConfig(max_bs=spec.cuda_graph_max_bs, max_context=longest, block=block)
        elif spec.prefill_graph_tokens:
            graphs = GraphConfig(max_bs=0, max_context=longest, prefill_tokens=spec.prefill_graph_tokens)
        self.runner = ModelRunner(self.model, num_pages=num_pages, page_size=spec.page_size, device=self.device,
                                  draft=self.draft, draft_projection=self.projection, graphs=graphs,
                                  kv_dtype=KV_DTYPES.get(spec.kv_cache_dtype), mtp=self.mtp)
        if spec.warmup_tokens:
            verify = (self.block_size or 1) if spec.role == "decode" else 1  # a step's verify rows per request
            warm_up(self.runner, spec.warmup_tokens * verify, longest)
        config = spec.transport
        if spec.nextn_steps is not None and spec.send_draft_kv:
            # The commit record carries the MTP's seed too (engine/mtp_seed.py): hidden_size in
            # the instance dtype. Every rank of both roles sizes its slots alike (same config).
            config = dataclasses.replace(config, meta_slot_bytes=config.meta_slot_bytes
                                         + seed_bytes(self.cfg.hidden_size, self.dtype))
        self.transfer = TransferEngine(spec.role, spec.instance, tp_size=spec.tp_size, tp_rank=spec.tp_rank,
                                       pp_size=spec.pp_size, pp_rank=spec.pp_rank, config=config)
        for name, pool in self.runner.pools:
            if name in (DRAFT_KV, *MTP_POOLS) and spec.role == "prefill" and not spec.send_draft_kv:
                continue  # decode builds the draft context itself after the handoff
            self.transfer.register_pool(name, pool.tensor, layers=pool.layers, total_heads=pool.total_heads)
        self.transfer.start(spec.bootstrap_address)

    @property
    def sends_draft_kv(self) -> bool:
        """Prefill: this rank's transfers carry the prompt's draft context KV."""
        return (self.draft is not None or self.mtp is not None) and self.spec.send_draft_kv

    @property
    def block_size(self) -> int | None:
        """The draft's block size (tokens a verify checks, the bonus slot included); None without one."""
        if self.mtp is not None:
            return self.mtp.block_size
        return self.draft.cfg.block_size if self.draft is not None else None

    @property
    def bytes_per_page(self) -> int:
        return self.runner.pools.bytes_per_page()

    @property
    def draft_bytes_per_page(self) -> int:
        """Of `bytes_per_page`, the draft's pools': a transfer carries them only with the draft KV sent."""
        return sum(pool.bytes_per_page() for name, pool in self.runner.pools if name in (DRAFT_KV, *MTP_POOLS))

    def forward(self, chunks: list[SeqChunk], tokens: DeviceTokens | None = None) -> list[torch.Tensor]:
        return self.runner.forward(chunks, tokens=tokens)

    def decode_rows(self, chunks: list[SeqChunk], tokens: DeviceTokens | None = None) -> torch.Tensor:
        return self.runner.decode_rows(chunks, tokens)

    def forward_microbatches(self, microbatches: list[list[SeqChunk]],
                             pipe: StagePipe | None = None) -> list[list[torch.Tensor]] | None:
        """This stage's part of a pipelined step (pipeline.py); the logits on the last stage."""
        return run_microbatches(self.runner, pipe, microbatches, pipe.stats if pipe is not None else None)

    def spec_step(self, blocks: list[DraftBlock]) -> SpecOutput:
        """One speculative step for a batch (`ModelRunner.spec_step`: graphs when they hold it)."""
        return self.runner.spec_step(blocks)

    def spec_launch(self, blocks: list[DraftBlock]) -> torch.Tensor | None:
        return self.runner.spec_launch(blocks)

    def spec_relaunch(self, m: int, reach: int) -> torch.Tensor | None:
        return self.runner.spec_relaunch(m, reach)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy KV pages src[i] -> dst[i] in every pool (target, indexer, draft): page is dim 0."""
        if not src:
            return
        s = torch.tensor(src, dtype=torch.long, device=self.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.device)
        for _, pool in self.runner.pools:
            pool.tensor.index_copy_(0, d, pool.tensor.index_select(0, s))

    def create_sender(self, room: Room, decode_instance: str) -> KVSender:
        return self.transfer.create_sender(room, decode_instance)

    def create_receiver(self, room: Room, bootstrap_address: str, dst_pages: list[int]) -> KVReceiver:
        return self.transfer.create_receiver(room, bootstrap_address, dst_pages=dst_pages)

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
