"""Tensor-parallel group: the collectives the model needs (sum all-reduce, all-gather, and the
all-to-all of expert parallelism), with byte counters, and the divisibility check the server runs
at start-up.

A `TPGroup` is passed into the model explicitly; there is no global group. Size 1 is a trivial
group that never touches torch.distributed, so a single process needs no `init_process_group`.
Every rank must call the collectives in the same order (the model does: its forward is the same
program on every rank).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from glm53.models.config import ConfigError, GlmConfig
from glm53.models.expert_parallel import check_ep


@dataclass
class CommStats:
    """What this rank handed to collectives since the last `reset`: bytes are this rank's input
    tensors (an all-gather's result is `size` times its input)."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    all_gather_calls: int = 0
    all_gather_bytes: int = 0
    all_to_all_calls: int = 0
    all_to_all_bytes: int = 0  # rows this rank sent (its own rows kept included)

    def reset(self) -> None:
        self.all_reduce_calls = self.all_reduce_bytes = 0
        self.all_gather_calls = self.all_gather_bytes = 0
        self.all_to_all_calls = self.all_to_all_bytes = 0


@dataclass
class TPGroup:
    """This rank's place in a tensor-parallel group. Build it with `TPGroup.single()` or
    `TPGroup.from_process_group(pg)` (gloo on CPU, NCCL on CUDA)."""

    rank: int
    size: int
    process_group: dist.ProcessGroup | None = None
    stats: CommStats = field(default_factory=CommStats)
    # A group for building one rank's shard to count its shapes (`glm53-serve plan`, on the meta
    # device): no process group, and a collective is an error.
    shapes_only: bool = False

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup: rank {self.rank} is not in [0, {self.size})")
        if self.size > 1 and self.process_group is None and not self.shapes_only:
            raise ValueError("TPGroup: a group of more than one rank needs a torch.distributed process group")

    @classmethod
    def single(cls) -> "TPGroup":
        return cls(rank=0, size=1)

    @classmethod
    def for_shapes(cls, size: int, rank: int = 0) -> "TPGroup":
        """Rank `rank` of a group of `size`, for building its shard's parameters only."""
        return cls(rank=rank, size=size, shapes_only=True)

    def _check_runs(self) -> None:
        if self.shapes_only:
            raise RuntimeError("TPGroup.for_shapes: a group for counting shapes runs no collective")

    @classmethod
    def from_process_group(cls, pg: dist.ProcessGroup | None = None) -> "TPGroup":
        """The group `pg` (the default world group when None) as seen from this process."""
        pg = pg if pg is not None else dist.group.WORLD
        return cls(rank=dist.get_rank(pg), size=dist.get_world_size(pg), process_group=pg)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns `t`. Every rank gets the same values bit for bit
        (the reduced result is computed once and distributed), which keeps replicated layers
        identical on all ranks."""
        if self.size == 1:
            return t
        self._check_runs()
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_bytes += t.numel() * t.element_size()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return t
        self._check_runs()
        t = t.contiguous()
        self.stats.all_gather_calls += 1
        self.stats.all_gather_bytes += t.numel() * t.element_size()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.process_group)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of `t` [sum(send), ...] in rank order, `send[d]` of them to rank d; returns the
        rows sent to this rank, [sum(recv), ...], `recv[s]` from rank s in rank order. Every rank
        must pass the sizes its peers pass (recv[s] here = send[this rank] on rank s)."""
        if self.size == 1:
            return t
        t = t.contiguous()
        self.stats.all_to_all_calls += 1
        self.stats.all_to_all_bytes += t.numel() * t.element_size()
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t, recv, send, group=self.process_group)
        return out


def check_tp(cfg: GlmConfig, tp: int, fp8: Collection[str] = (), ep: int = 1) -> None:
    """Raises `ConfigError` naming the first dimension that `tp` ranks (with `ep` expert groups)
    cannot split evenly.

    Split: attention heads (q_b_proj / kv_b_proj / o_proj), the routed experts (when the config
    has MoE layers: into ep ranges of expert ids, and each expert's intermediate width into
    tp / ep parts, `expert_parallel.check_ep`), the shared experts' width (moe_intermediate_size ×
    n_shared_experts, by tp), the dense layers' intermediate width (when it has dense layers), and
    the vocabulary (embedding and lm_head). The DSA indexer, the router and the MLA latent
    projections are replicated, so nothing about them needs to divide.

    `fp8`: the parameters kept block-FP8 (`GlmForCausalLM`'s `fp8`, from the checkpoint). Each
    rank's part of a split FP8 weight must then be whole weight blocks (`check_fp8_tp`).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {tp!r}")
    if cfg.num_attention_heads % tp:
        raise ConfigError(f"num_attention_heads: {cfg.num_attention_heads} is not divisible by "
                          f"tensor_parallel_size={tp}")
    check_ep(cfg, tp, ep)
    dims = []
    if any(t == "sparse" for t in cfg.mlp_layer_types) and cfg.n_shared_experts:
        dims.append(("shared experts' width (moe_intermediate_size × n_shared_experts)",
                     cfg.moe_intermediate_size * cfg.n_shared_experts))
    if any(t == "dense" for t in cfg.mlp_layer_types):
        dims.append(("intermediate_size", cfg.intermediate_size))
    dims.append(("vocab_size", cfg.vocab_size))
    for name, value in dims:
        if value % tp:
            raise ConfigError(f"{name}: {value} is not divisible by tensor_parallel_size={tp}")
    if fp8:
        check_fp8_tp(cfg, tp, fp8, ep)


# Split block-FP8 weights by parameter name: (pattern, what is split, its width from the config,
# the split dimension (None: gate/up rows, down columns), whether expert parallelism applies: the
# routed experts' width is split by tp / ep, everything else by tp). kv_b_proj is absent: the
# model holds it dequantized (the absorbed attention reads it per head).
_FP8_SPLITS = (
    (r"\.self_attn\.q_b_proj\.weight$", "q_b_proj rows (num_attention_heads × qk_head_dim)",
     lambda c: c.num_attention_heads * c.qk_head_dim, 0, False),
    (r"\.self_attn\.o_proj\.weight$", "o_proj columns (num_attention_heads × v_head_dim)",
     lambda c: c.num_attention_heads * c.v_head_dim, 1, False),
    (r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)$", "moe_intermediate_size",
     lambda c: c.moe_intermediate_size, None, True),
    (r"\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$",
     "shared experts' width (moe_intermediate_size × n_shared_experts)",
     lambda c: c.moe_intermediate_size * c.n_shared_experts, None, False),
    (r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$", "intermediate_size", lambda c: c.intermediate_size, None,
     False),
)


def check_fp8_tp(cfg: GlmConfig, tp: int, fp8: Collection[str], ep: int = 1) -> None:
    """Raises `ConfigError` naming the first block-FP8 parameter in `fp8` whose tensor-parallel
    part is not whole `weight_block_size` blocks of the split dimension: its scales could not be
    split with it. (GLM-5-FP8, 128-blocks: tp 1, 2, 4, 8 and 16; at 32 an expert's 2048-wide
    intermediate gives parts of 64.) Routed experts are split by tp / ep (`expert_parallel`)."""
    if tp == 1:
        return
    block = cfg.weight_block_size or (128, 128)
    for name in sorted(fp8):
        for pattern, what, width, dim, routed in _FP8_SPLITS:
            m = re.search(pattern, name)
            if m is None:
                continue
            if dim is None:  # gate/up split their rows, down its columns
                dim = 1 if m.group(1) == "down_proj" else 0
            parts = tp // ep if routed else tp
            part = width(cfg) // parts
            if part % block[dim]:
                by = f"tensor_parallel_size={tp}" + (f" with expert_parallel_size={ep}" if routed and ep > 1 else "")
                raise ConfigError(
                    f"{name}: {by} splits its {what}, {width(cfg)}, into parts of {part}, "
                    f"not whole {block[dim]}-wide FP8 weight blocks; use a tp that does, or dtype bfloat16 to "
                    f"dequantize the weights at load")
            break
