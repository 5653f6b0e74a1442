"""glm53.kernels: one module per op (torch reference, Triton kernel, dispatcher)."""

from glm53.kernels.indexer_logits import indexer_logits
from glm53.kernels.sparse_mla import sparse_mla
from glm53.kernels.topk import dsa_topk, dsa_topk_paged

__all__ = ["dsa_topk", "dsa_topk_paged", "indexer_logits", "sparse_mla"]
