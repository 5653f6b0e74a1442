"""Whether a model fits a layout, from its config.json alone (`glm53-serve plan`, and `up` before
it starts anything).

Each pipeline stage's rank-0 shard is built on the meta device, exactly as a rank builds it
(same classes, same tp split, the checkpoint's FP8 weights kept FP8 under dtype "auto"), and its
parameters and buffers are counted: the weight bytes are the model's, not a formula. KV bytes per
token come from the same pool rules the engine allocates with (`kv_cache.target_pools`, the
draft's `draft_kv` pool on the last stage).

Memory of one GPU, as the engine spends it (engine/worker.py `kv_pages`):
- `mem_fraction_static` of the GPU holds the weights, then the KV pools fill what is left of it;
- the rest, `1 - mem_fraction_static`, is the reserve for activations, CUDA graphs, the CUDA
  context and the communication buffers. The plan states an estimate of what a step needs there
  (`activation_bytes`) and refuses a layout whose reserve is smaller.
The instance's KV capacity is its tightest stage's (its ranks agree on one page count).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from glm53.models.config import GlmConfig
from glm53.models.fused import fuse_projections_, padding_bytes
from glm53.models.parallel import TPGroup

GIB = 2**30
GB = 10**9
# What CUDA reports for one H200 (143,771 MiB): the planned GPU when none is given or present.
H200_BYTES = 143_771 * 2**20
# Part of the reserve no step size changes: the CUDA context, cuBLAS/Triton workspaces, NCCL and
# UCX buffers, the CUDA-graph memory pool's fixed part.
FIXED_RESERVE_BYTES = 3 * GIB
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_KV_FP8 = "fp8_e4m3"


@dataclass(frozen=True)
class Layout:
    """One instance's shape and memory knobs (the `plan` flags; `up` takes them from the YAML)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert groups of the TP group (models/expert_parallel.py): each holds E / ep experts
    dtype: str = "auto"  # "auto": the checkpoint's dtype, block-FP8 weights kept FP8
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "fp8_e4m3": the FP8 KV layouts
    gpu_bytes: int = H200_BYTES
    mem_fraction_static: float = 0.85
    context_length: int | None = None  # None: the model's max_position_embeddings
    chunked_prefill_size: int = 8192
    max_running_requests: int = 64
    kv_tokens: int | None = None  # fixed by the YAML (num_pages × page_size, max_total_tokens)
    draft_path: str | None = None  # a DFlash-family draft on the last stage
    nextn: bool = False  # NEXTN: the checkpoint's MTP layer drafts on the last stage (its weights, its pools)
    shares_weights: bool = False  # a colocated instance using its partner's copy of the weights
    others_fraction: float = 0.0  # mem_fraction_static of the other instances on the same GPUs
    prefill_graph_tokens: int = 0  # a prefill instance's graphs of chunks up to this many tokens (their pool)


@dataclass(frozen=True)
class StagePlan:
    layers: range
    weight_bytes: int  # this stage's rank-0 parameters and buffers, the draft's included
    draft_weight_bytes: int
    kv_pools: dict[str, int]  # pool name -> bytes one token costs on this rank
    max_kv_tokens: int

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(self.kv_pools.values())


@dataclass(frozen=True)
class Plan:
    layout: Layout
    stages: list[StagePlan]
    reserve_bytes: int
    activation_bytes: int
    fp8_weights: int  # parameters held block-FP8 per rank-0 shard of the whole model
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def weight_bytes_per_gpu(self) -> int:
        return max(s.weight_bytes for s in self.stages)

    @property
    def kv_bytes_per_token(self) -> int:
        return max(s.kv_bytes_per_token for s in self.stages)

    @property
    def max_kv_tokens(self) -> int:
        return min(s.max_kv_tokens for s in self.stages)

    def summary(self) -> dict:
        """The last line `plan` prints."""
        return {"fits": self.fits, "weight_bytes_per_gpu": self.weight_bytes_per_gpu,
                "kv_bytes_per_token": self.kv_bytes_per_token, "max_kv_tokens": self.max_kv_tokens}

    def reason(self) -> str:
        """One sentence naming the numbers (empty when it fits)."""
        return "; ".join(self.problems)

    def lines(self) -> list[str]:
        lay = self.layout
        out = [f"layout: tp={lay.tp} pp={lay.pp} ep={lay.ep} dtype={lay.dtype} kv_cache_dtype={lay.kv_cache_dtype}; "
               f"GPU {_gib(lay.gpu_bytes)}, mem_fraction_static {lay.mem_fraction_static:g} "
               f"({_gib(lay.gpu_bytes * lay.mem_fraction_static)} for weights and KV)"]
        for k, s in enumerate(self.stages):
            pools = ", ".join(f"{n} {b} B" for n, b in s.kv_pools.items())
            draft = f" (draft {_gib(s.draft_weight_bytes)})" if s.draft_weight_bytes else ""
            out.append(f"stage {k} (layers {s.layers.start}-{s.layers.stop - 1}), per GPU: weights "
                       f"{_gib(s.weight_bytes)}{draft}; KV {s.kv_bytes_per_token} B/token ({pools}); "
                       f"KV capacity {s.max_kv_tokens} tokens")
        out.append(f"reserve outside mem_fraction_static: {_gib(self.reserve_bytes)} for activations, CUDA graphs "
                   f"and buffers; a step needs about {_gib(self.activation_bytes)} (prefill chunk of "
                   f"{lay.chunked_prefill_size} tokens over {self._context()} of context, "
                   + (f"the prefill graphs' pool of a {lay.prefill_graph_tokens}-token chunk, "
                      if lay.prefill_graph_tokens else "") + f"{_gib(FIXED_RESERVE_BYTES)} fixed)")
        out.append(f"instance: {self.max_kv_tokens} KV tokens" + (" (fixed by the config)" if lay.kv_tokens else ""))
        if not self.fits:
            out.append(f"does not fit: {self.reason()}")
        return out

    def _context(self) -> int:
        return self.layout.context_length or 0


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _nbytes(module: torch.nn.Module) -> int:
    """What `module` holds: its parameters and buffers, and the padding rows of its fused products
    (`models/fused`)."""
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) + padding_bytes(module)


def activation_bytes(cfg: GlmConfig, lay: Layout, context: int, tp: int, block: int) -> int:
    """An estimate of the most a step allocates beyond weights and KV: a prefill chunk's
    (`chunk_bytes`) and a decode step's fp32 logits (every running request × the verify block × the
    vocabulary), plus the fixed part; a prefill instance's graphs (`prefill_graph_tokens`) keep
    their largest chunk's activations in a pool of their own, on top."""
    logits = lay.max_running_requests * block * cfg.vocab_size * 4
    graphs = chunk_bytes(cfg, lay, lay.prefill_graph_tokens, context, tp) if lay.prefill_graph_tokens else 0
    return chunk_bytes(cfg, lay, lay.chunked_prefill_size, context, tp) + logits + graphs + FIXED_RESERVE_BYTES


def chunk_bytes(cfg: GlmConfig, lay: Layout, c: int, context: int, tp: int) -> int:
    """A prompt chunk of `c` tokens: its indexer scores (fp32, chunk × context), its residual
    stream and layer outputs (8 fp32 rows of the hidden width per token), its routed rows through
    gate/up and down."""
    width = 2  # bf16 activations
    scores = c * context * 4
    hidden = 8 * c * cfg.hidden_size * 4
    # routed rows through gate/up (the width a rank holds: tp / ep ranks split an expert) and down;
    # under EP a rank's rows are its experts' share of every rank's tokens, about as many
    moe = c * cfg.num_experts_per_tok * (2 * cfg.moe_intermediate_size * lay.ep // tp + cfg.hidden_size) * width
    return scores + hidden + moe


def _nextn_bytes(model_dir: Path, cfg: GlmConfig, lay: Layout, dtype: torch.dtype, tp: TPGroup,
                 target_fp8: frozenset[str]) -> int:
    """The MTP layer's rank-0 bytes on the last stage, built on the meta device as the ranks load it
    (engine/worker.py: an embedding of its own under PP). Its layout and FP8 weights come from the
    checkpoint's tensor names when its index is there; else the DeepSeek-V3 NextN layout GLM-5
    ships (its own embedding and head, MoE as the last layer) with the target's last
    layer's FP8 weights mapped onto it."""
    from glm53.models.mtp import NextNSpec, nextn_spec
    from glm53.models.mtp_weights import nextn_on_meta
    from glm53.models.weights import checkpoint_files, fp8_param_names

    L = cfg.num_hidden_layers
    try:
        files = checkpoint_files(model_dir)
    except ValueError:
        files = None
    if files is not None:
        spec = nextn_spec(cfg, files)
        fp8 = frozenset(n for n in fp8_param_names(cfg, files) if n.startswith(f"model.layers.{L}.")) if target_fp8 \
            else frozenset()
    else:
        last = f"model.layers.{L - 1}."
        fp8 = frozenset(n.replace(last, f"model.layers.{L}.", 1) for n in target_fp8 if n.startswith(last))
        spec = NextNSpec(L, moe=cfg.mlp_layer_types[-1] == "sparse", own_head=True, own_embed=True, fp8=bool(fp8))
    layer = nextn_on_meta(cfg, spec, fp8, dtype=dtype, tp=tp, ep=lay.ep, embed=lay.pp > 1)
    fuse_projections_(layer)  # as the runner serves it
    return _nbytes(layer)


def plan_instance(model_dir: str | Path, lay: Layout) -> Plan:
    """Builds each stage's rank-0 shard on the meta device and plans one GPU of each."""
    from glm53.models.draft import DFlashDraft, draft_kv_bytes_per_token
    from glm53.models.draft_projection import DraftProjection
    from glm53.models.draft_config import DFlashConfig
    from glm53.models.kv_cache import FP8, target_pools
    from glm53.models.model import GlmForCausalLM
    from glm53.models.mtp import NextNDraft
    from glm53.models.parallel import check_tp
    from glm53.models.weights import checkpoint_files, fp8_param_names, glm5_fp8_param_names
    from glm53.server.engine.worker import stage_layers

    model_dir = Path(model_dir)
    cfg = GlmConfig.from_dir(model_dir)
    dtype = _DTYPES.get(cfg.torch_dtype if lay.dtype == "auto" else lay.dtype, torch.bfloat16)
    kv_dtype = FP8 if lay.kv_cache_dtype == _KV_FP8 else dtype
    tp = TPGroup.for_shapes(lay.tp)
    context = min(lay.context_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
    lay = dataclasses.replace(lay, context_length=context)
    draft_cfg = DFlashConfig.from_dir(lay.draft_path, cfg) if lay.draft_path else None

    fp8: frozenset[str] = frozenset()
    if lay.dtype == "auto" and cfg.quant_method == "fp8":
        # The checkpoint's tensor names when it is there (its index: no weight is read), else the
        # GLM-5-FP8 layout applied to the model's tensors.
        try:
            fp8 = fp8_param_names(cfg, checkpoint_files(model_dir))
        except ValueError:
            check_tp(cfg, lay.tp, ep=lay.ep)
            with torch.device("meta"):
                whole = GlmForCausalLM(cfg, dtype=dtype, tp=tp, ep=lay.ep)
            fp8 = glm5_fp8_param_names(cfg, whole)

    budget = lay.gpu_bytes * lay.mem_fraction_static
    stages: list[StagePlan] = []
    fp8_held = 0
    problems: list[str] = []
    ranges = stage_layers(cfg.num_hidden_layers, lay.pp)
    for k, layers in enumerate(ranges):
        with torch.device("meta"):
            model = GlmForCausalLM(cfg, dtype=dtype, layers=layers, tp=tp, fp8=fp8, ep=lay.ep)
            fuse_projections_(model)  # as the runner serves it: block-FP8 members padded to whole blocks
            draft_bytes = 0
            if draft_cfg is not None and k == len(ranges) - 1:
                draft_bytes = _nbytes(DFlashDraft(draft_cfg, cfg, dtype=dtype, tp=tp))
            elif draft_cfg is not None:
                ids = tuple(i for i in draft_cfg.target_layer_ids if i in layers)
                if ids:
                    h = draft_cfg.hidden_size
                    draft_bytes = _nbytes(DraftProjection(torch.empty(h, len(ids) * h, dtype=dtype), ids))
        fp8_held += len(model.fp8_params)
        weights = 0 if lay.shares_weights else _nbytes(model) + draft_bytes
        pools = {name: pool.bytes_per_page()
                 for name, pool in target_pools(cfg, layers, 1, 1, dtype, device="meta", kv_dtype=kv_dtype)}
        if draft_cfg is not None and k == len(ranges) - 1:
            pools["draft_kv"] = draft_kv_bytes_per_token(draft_cfg, dtype, lay.tp)
        if lay.nextn and k == len(ranges) - 1 and cfg.num_nextn_predict_layers >= 1:
            mtp_bytes = _nextn_bytes(model_dir, cfg, lay, dtype, tp, fp8)
            draft_bytes += mtp_bytes
            weights += 0 if lay.shares_weights else mtp_bytes
            pools["mtp_kv+mtp_index_k"] = NextNDraft.kv_bytes_per_token(cfg, dtype)
        per_token = sum(pools.values())
        tokens = max(0, int((budget - weights) // per_token)) if lay.kv_tokens is None else lay.kv_tokens
        stages.append(StagePlan(layers, weights, 0 if lay.shares_weights else draft_bytes, pools, tokens))
        if weights + (lay.kv_tokens or 0) * per_token > budget:
            what = f"weights {_gib(weights)}" + (f" and {lay.kv_tokens} KV tokens {_gib(lay.kv_tokens * per_token)}"
                                                 if lay.kv_tokens else "")
            problems.append(f"stage {k}'s {what} exceed mem_fraction_static {lay.mem_fraction_static:g} × "
                            f"{_gib(lay.gpu_bytes)} = {_gib(budget)} per GPU")

    block = draft_cfg.block_size if draft_cfg is not None else 1
    act = activation_bytes(cfg, lay, context, lay.tp, block)
    # Instances sharing a GPU share what none of them claims.
    reserve = int(lay.gpu_bytes * (1 - lay.mem_fraction_static - lay.others_fraction))
    capacity = min(s.max_kv_tokens for s in stages)
    if not problems and lay.kv_tokens is None and capacity < context:
        problems.append(f"{capacity} KV tokens per instance is less than one request of the context length {context}")
    if reserve < act:
        problems.append(f"the reserve outside mem_fraction_static, {_gib(reserve)}, is less than the {_gib(act)} a step "
                        f"needs; lower mem_fraction_static or chunked_prefill_size")
    return Plan(lay, stages, reserve, act, fp8_held, problems)


def render(plan: Plan) -> str:
    """What `plan` prints: the human lines, then one JSON object on the last line."""
    return "\n".join([*plan.lines(), json.dumps(plan.summary())])


def gpu_bytes_here(device: int = 0) -> int | None:
    """GPU `device`'s memory as nvidia-smi reports it, or None without one. (Not through torch:
    that would create a CUDA context in `up`'s own process, which holds memory on the GPU for as
    long as the server runs.)"""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--id={device}", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def instance_layout(cluster, inst, gpu_bytes: int) -> Layout:
    """The `Layout` of one GPU instance of a cluster config (config.ClusterConfig / InstanceConfig)."""
    from glm53.server.engine.worker import prefill_graph_tokens  # lazy, as plan_instance's: the engine's modules

    eng = inst.engine
    kv_tokens = eng.num_pages * eng.page_size if eng.num_pages is not None else eng.max_total_tokens
    partner = None
    if inst.colocate is not None:
        partner = next((d for d in cluster.pool("decode") if d.name == inst.colocate), None)
    # engine/worker.py RankSpec.same_weights: a colocated pair of unsharded ranks of one model shares them.
    shares = (partner is not None and inst.tp == partner.tp == 1 and inst.pp == partner.pp
              and eng.dtype == partner.engine.dtype)
    # Other instances on any of this one's GPUs (a colocated pair; config_checks bounds the sum).
    mine = set(inst.devices)
    others = sum(o.engine.mem_fraction_static for o in cluster.instances
                 if o is not inst and o.host == inst.host and o.engine.device == "cuda" and mine & set(o.devices))
    spec = cluster.speculative
    return Layout(tp=inst.tp, pp=inst.pp, ep=inst.ep, dtype=eng.dtype, kv_cache_dtype=eng.kv_cache_dtype, gpu_bytes=gpu_bytes,
                  mem_fraction_static=eng.mem_fraction_static, context_length=cluster.model.context_length,
                  chunked_prefill_size=eng.chunked_prefill_size, max_running_requests=eng.max_running_requests,
                  kv_tokens=kv_tokens, draft_path=spec.draft_model_path if spec.enabled and not spec.nextn else None,
                  nextn=spec.enabled and spec.nextn, shares_weights=shares, others_fraction=others,
                  prefill_graph_tokens=prefill_graph_tokens(cluster, inst))


def plan_cluster(cluster, model_dir: str | Path, gpu_bytes: int | None = None) -> dict[str, Plan]:
    """Every GPU instance's plan, keyed by its config path ("decode[0]"). `gpu_bytes`: the GPU
    to plan for; None: this host's (nvidia-smi, the instance's first device), else an H200."""
    from glm53.models.config import ConfigError as ModelConfigError
    from glm53.server.config import ROLES, ConfigError

    plans = {}
    for role in ROLES:
        for i, inst in enumerate(cluster.pool(role)):
            if inst.engine.device != "cuda":
                continue  # CPU instances size their KV by num_pages / max_total_tokens / 64K tokens
            g = gpu_bytes or gpu_bytes_here(inst.devices[0] if inst.devices else 0) or H200_BYTES
            try:
                plans[f"{role}[{i}]"] = plan_instance(model_dir, instance_layout(cluster, inst, g))
            except ModelConfigError as e:  # e.g. a tp whose parts cut the FP8 weights' 128-blocks
                raise ConfigError(cluster.source, f"{role}[{i}].tp", f"{e} (model {model_dir})") from None
    return plans


def check_cluster_fits(cluster, model_dir: str | Path, gpu_bytes: int | None = None) -> dict[str, Plan]:
    """`plan_cluster`, raising ConfigError naming the first instance that does not fit."""
    from glm53.server.config import ConfigError

    plans = plan_cluster(cluster, model_dir, gpu_bytes)
    for key, plan in plans.items():
        if not plan.fits:
            raise ConfigError(cluster.source, key, f"does not fit its GPUs: {plan.reason()} "
                              f"(glm53-serve plan --config {cluster.source} shows the whole plan)")
    return plans
