"""glm53.models: GLM-5 config and indexer schedule, target model, weight loading, KV pools."""

from glm53.models.config import ConfigError, GlmConfig, indexer_schedule
from glm53.models.kv_cache import KVPool, OutOfPages, PageAllocator
from glm53.models.runner import ModelRunner, SeqChunk
from glm53.models.weights import WeightError, load_weights

__all__ = [
    "ConfigError", "GlmConfig", "indexer_schedule", "KVPool", "OutOfPages", "PageAllocator",
    "ModelRunner", "SeqChunk", "WeightError", "load_weights",
]
