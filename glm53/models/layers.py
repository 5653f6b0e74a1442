"""Building blocks whose parameters carry their shard rule (`sharding.Shard`): replicated and
tensor-parallel linears, vocab-parallel embedding and lm_head, norms, the SwiGLU MLP.

Column-parallel layers split the output features and leave their output split (the consumer is
per-head attention or a row-parallel layer); row-parallel layers split the input features and
sum partial outputs with one all-reduce, unless the caller folds that sum into a later one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from glm53.kernels.moe import swiglu_mlp
from glm53.models.parallel import TPGroup
from glm53.models.sharding import REPLICATED, Shard


def param(*shape: int, dtype: torch.dtype, shard: Shard = REPLICATED) -> nn.Parameter:
    """A parameter of the local `shape`, tagged with the rule that maps it to its checkpoint tensor."""
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.shard = shard
    return p


def split(n: int, tp: TPGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}: {n} is not divisible by the tensor-parallel size {tp.size}")
    return n // tp.size


class Linear(nn.Module):
    """Replicated: every rank holds the whole weight."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class ColumnParallelLinear(Linear):
    """Output features split across ranks (rank r holds rows [r·n, (r+1)·n) of the weight); the
    output stays split."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, tp: TPGroup):
        nn.Module.__init__(self)
        n = split(out_features, tp, "output features")
        self.weight = param(n, in_features, dtype=dtype, shard=Shard(0, tp.rank, tp.size))


class RowParallelLinear(Linear):
    """Input features split across ranks; `forward` sums the partial outputs over ranks."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, tp: TPGroup):
        nn.Module.__init__(self)
        self.tp = tp
        n = split(in_features, tp, "input features")
        self.weight = param(out_features, n, dtype=dtype, shard=Shard(1, tp.rank, tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return self.tp.all_reduce(out) if self.reduce else out
