"""Building blocks whose parameters carry their shard rule (`sharding.Shard`): replicated and
tensor-parallel linears, vocab-parallel embedding and lm_head, norms, the SwiGLU MLP.

Column-parallel layers split the output features and leave their output split (the consumer is
per-head attention or a row-parallel layer); row-parallel layers split the input features and
sum partial outputs with one all-reduce, unless the caller folds that sum into a later one.

Block-FP8 (DESIGN §4.8): a linear whose checkpoint tensor is block-FP8 can hold it as is
(`Linear.to_fp8`): `weight` float8_e4m3fn and `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)],
each parameter with its own shard rule (the scale's cuts the same dimension into the blocks of
the weight's part, so a part must span whole blocks: a `ConfigError` names the layer and tp
otherwise), and its product runs `kernels.fp8_gemm.fp8_gemm` (CPU: the exact dequantized
reference). Where that product quantizes its input (prefill sizes on a GPU), the kernel before it
writes the input quantized instead (`kernels.fp8_act`, through `norm_for` and the MLP's SwiGLU) and
the layer takes the `Fp8Rows`. `materialize_` allocates a model built on the meta device on its
target device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm53.kernels.fp8_act import Fp8Rows, add_rms_norm_fp8, rms_norm_fp8, silu_mul_fp8
from glm53.kernels.fp8_gemm import fp8_gemm, fp8_gemm_rows, takes_fp8_rows
from glm53.kernels.moe import swiglu_mlp
from glm53.kernels.norm import add_rms_norm, rms_norm
from glm53.kernels.row_parts import RowParts
from glm53.kernels.swiglu import silu_mul
from glm53.models.config import ConfigError
from glm53.models.fused import FusedLinear
from glm53.models.parallel import TPGroup
from glm53.models.sharding import REPLICATED, Shard, shard_of

FP8 = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"  # checkpoint: `<name>.weight` (e4m3) + `<name>.weight_scale_inv` (fp32)


def param(*shape: int, dtype: torch.dtype, shard: Shard = REPLICATED,
          device: torch.device | str | None = None) -> nn.Parameter:
    """A parameter of the local `shape`, tagged with the rule that maps it to its checkpoint tensor."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    p.shard = shard
    return p


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_pair(w: nn.Parameter, name: str, block: int) -> tuple[nn.Parameter, nn.Parameter]:
    """The block-FP8 form of the (meta or empty) weight `w` [..., N, K] (leading dims: stacked
    experts; its rule describes one expert's tensor): an e4m3 parameter of the same shape and rule
    and its scales [..., ceil(N/block), ceil(K/block)] fp32, split by the same rule. Under tensor
    parallelism the scales split equally only if each rank's part of the split dimension is whole
    blocks (then block row r of the part is block row r + rank·part/block of the tensor); else this
    is a `ConfigError` naming the parameter and tp."""
    rule = shard_of(w)
    *lead, n, k = w.shape
    if not rule.replicated:
        local = (n, k)[rule.dim]
        if local % block:
            full = rule.full_shape((n, k))
            raise ConfigError(
                f"{name}: tensor_parallel_size={rule.size} splits dimension {rule.dim} of this block-FP8 weight "
                f"{full} into parts of {local}, which is not a multiple of the {block}-wide weight blocks (each "
                f"rank must hold whole blocks); use a tp that does, or dtype bfloat16 to dequantize at load")
    q = param(*w.shape, dtype=FP8, shard=rule, device=w.device)
    s = param(*lead, _cdiv(n, block), _cdiv(k, block), dtype=torch.float32, shard=rule, device=w.device)
    return q, s


def materialize_(module: nn.Module, device: torch.device | str) -> None:
    """Allocates every parameter of `module` (built on the meta device) on `device`, uninitialised
    (the loader fills them), keeping each one's shard rule. (`Module.to_empty` would drop the
    rule.) Non-persistent buffers are the owner's to recompute."""
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                m._parameters[name] = param(*p.shape, dtype=p.dtype, shard=shard_of(p), device=device)


def split(n: int, tp: TPGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}: {n} is not divisible by the tensor-parallel size {tp.size}")
    return n // tp.size


class Linear(nn.Module):
    """Replicated: every rank holds the whole weight. `dtype` is the weight's and the output's;
    after `to_fp8` the weight is e4m3 with block scales and the output stays in `dtype`."""

    # Whether this layer may hold its weight block-FP8 (a consumer that reads the weight itself,
    # as the absorbed attention reads kv_b_proj's, sets it False: the loader then dequantizes).
    fp8_ok = True

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self._init(dtype, param(out_features, in_features, dtype=dtype))

    def _init(self, dtype: torch.dtype, weight: nn.Parameter) -> None:
        self.dtype = dtype
        self.weight = weight
        self.register_parameter("weight_scale_inv", None)

    @property
    def fp8(self) -> bool:
        return self.weight_scale_inv is not None

    def to_fp8(self, prefix: str, names: frozenset[str], block: int) -> set[str]:
        """Holds the weight block-FP8 if the checkpoint stores `<prefix>.weight` so (`names`) and
        this layer may; returns the parameter names converted."""
        name = f"{prefix}.weight"
        if name not in names or not self.fp8_ok:
            return set()
        self.weight, self.weight_scale_inv = fp8_pair(self.weight, name, block)
        return {name}

    def takes_fp8_rows(self, m: int) -> bool:
        """Whether this layer's product of m rows reads its input quantized (`fp8_act`)."""
        return takes_fp8_rows(m, *self.weight.shape, self.weight.device, self.fp8)

    def matmul(self, x: torch.Tensor | Fp8Rows, keep_parts: bool = False) -> torch.Tensor | RowParts:
        """This rank's product x @ W^T (no communication); x dense, or its rows a producer
        quantized when `takes_fp8_rows`. `keep_parts`: the sum of a split-K product may come back not
        taken yet (`row_parts`), for a norm that adds it to the residual stream."""
        if isinstance(x, Fp8Rows):
            return fp8_gemm_rows(x, self.weight, self.weight_scale_inv, self.dtype, keep_parts=keep_parts)
        if self.weight_scale_inv is not None:
            return fp8_gemm(x.to(self.dtype), self.weight, self.weight_scale_inv, self.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return self.matmul(x)


class ColumnParallelLinear(Linear):
    """Output features split across ranks (rank r holds rows [r·n, (r+1)·n) of the weight); the
    output stays split."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, tp: TPGroup):
        nn.Module.__init__(self)
        n = split(out_features, tp, "output features")
        self._init(dtype, param(n, in_features, dtype=dtype, shard=Shard(0, tp.rank, tp.size)))


class RowParallelLinear(Linear):
    """Input features split across ranks; `forward` sums the partial outputs over ranks."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, tp: TPGroup):
        nn.Module.__init__(self)
        self.tp = tp
        n = split(in_features, tp, "input features")
        self._init(dtype, param(out_features, n, dtype=dtype, shard=Shard(1, tp.rank, tp.size)))

    def forward(self, x: torch.Tensor | Fp8Rows, keep_parts: bool = False) -> torch.Tensor | RowParts:
        """`keep_parts` (`Linear.matmul`) on one rank only: the all-reduce takes the sum's rows."""
        if self.tp.size == 1:
            return self.matmul(x, keep_parts)
        return self.tp.all_reduce(self.matmul(x))


class VocabParallelEmbedding(nn.Module):
    """Rank r holds the rows of token ids [r·n, (r+1)·n); other ids embed to zero locally and the
    all-reduce fills them in (a sum of one row and zeros, so exact)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.n = split(vocab, tp, "vocab_size")
        self.start = tp.rank * self.n
        self.weight = param(self.n, hidden, dtype=dtype, shard=Shard(0, tp.rank, tp.size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.n)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0))


class ParallelLMHead(nn.Module):
    """Vocab-parallel output projection: each rank computes its vocab slice's logits, then the
    slices are all-gathered so every rank returns the full row (the scheduler samples from
    rank 0's and sends the token to all ranks)."""

    def __init__(self, hidden: int, vocab: int, dtype: torch.dtype, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.weight = param(split(vocab, tp, "vocab_size"), hidden, dtype=dtype, shard=Shard(0, tp.rank, tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(F.linear(x.to(self.weight.dtype), self.weight), dim=-1)


class Norm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype, bias: bool = False):
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        if bias:
            self.bias = param(dim, dtype=dtype)


class MLP(nn.Module):
    """SwiGLU MLP, tensor-parallel on the intermediate width. With `reduce=False` the output is
    this rank's partial sum (MoE adds it to the routed experts' partial sum and reduces once)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, tp: TPGroup, reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.gate_proj = ColumnParallelLinear(hidden, inter, dtype, tp)
        self.up_proj = ColumnParallelLinear(hidden, inter, dtype, tp)
        self.down_proj = RowParallelLinear(inter, hidden, dtype, tp)
        self.gate_up: FusedLinear | None = None
        # a MoE's shared expert held in the routed experts' stacks (`moe.Experts.absorb_`): the
        # MoE computes it there, this module only names its parameters
        self.in_expert_stack = False

    def fuse_projections_(self) -> int:
        """gate and up as one product (`models/fused`)."""
        if self.gate_up is None and not self.in_expert_stack:
            self.gate_up = FusedLinear.of([self.gate_proj, self.up_proj])
        return int(self.gate_up is not None)

    # the input as `norm_for` hands it: quantized rows when every product reading it takes them
    reads_dense = False

    def takes_fp8_rows(self, m: int) -> bool:
        if self.gate_up is not None:
            return self.gate_up.takes_fp8_rows(m)
        return self.gate_proj.takes_fp8_rows(m) and self.up_proj.takes_fp8_rows(m)

    def forward(self, x: torch.Tensor | Fp8Rows, keep_parts: bool = False) -> torch.Tensor | RowParts:
        """`keep_parts`: on one rank, with the reduce, the down product's sum may come back not taken
        yet (`Linear.matmul`), for the norm that adds it."""
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        keep_parts = keep_parts and self.reduce and self.tp.size == 1
        if self.gate_up is not None or isinstance(x, Fp8Rows) or g.fp8 or u.fp8 or d.fp8:
            gx, ux = self.gate_up(x) if self.gate_up is not None else (g.matmul(x), u.matmul(x))
            # the down product's input quantized by the SwiGLU itself where it would be anyway
            h = silu_mul_fp8(gx, ux) if gx.dim() == 2 and d.takes_fp8_rows(gx.shape[0]) else silu_mul(gx, ux)
            out = d.matmul(h, keep_parts)
        else:
            out = swiglu_mlp(x, g.weight, u.weight, d.weight)
        return self.tp.all_reduce(out) if self.reduce else out


def rows_of(x: torch.Tensor | Fp8Rows) -> int:
    return x.m if isinstance(x, Fp8Rows) else x.shape[0]


def norm_for(x: torch.Tensor, weight: torch.Tensor, eps: float, consumer: nn.Module,
             add: torch.Tensor | RowParts | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | Fp8Rows]:
    """RMSNorm of x [m, D] (of x + `add`, the residual add in the same pass; `add` may be a sum not
    taken yet, `row_parts`, which the norm takes) as `consumer` (a
    module with `takes_fp8_rows(m)` and `reads_dense`) reads it: (the residual sum, x itself
    without `add`; the dense norm, None when only quantized rows are needed; the consumer's input,
    the dense norm or its rows quantized in the same pass)."""
    if consumer.takes_fp8_rows(x.shape[0]):
        if add is None:
            return (x, *rms_norm_fp8(x, weight, eps, dense=consumer.reads_dense))
        return add_rms_norm_fp8(x, add, weight, eps, dense=consumer.reads_dense)
    s, y = (x, rms_norm(x, weight, eps)) if add is None else add_rms_norm(x, add, weight, eps)
    return s, y, y
