"""glm53.models: GLM-5 config and indexer schedule, target model (whole or one pipeline stage),
weight loading, named KV pools, the runner, tensor parallelism (`TPGroup`, `check_tp`), and the
DFlash-family drafts, DFlash and DSpark (config, model, loader, random-checkpoint writer)."""

from glm53.models.config import ConfigError, GlmConfig, indexer_schedule
from glm53.models.draft import (
    DRAFT_KV, DFlashDraft, DraftBlock, DraftSampling, add_draft_pools, draft_kv_bytes_per_token,
)
from glm53.models.draft_checkpoint import write_random_draft
from glm53.models.draft_projection import DraftProjection
from glm53.models.draft_config import DFlashConfig, build_target_layer_ids, check_draft_tp
from glm53.models.draft_weights import build_draft, draft_config, load_draft_projection, load_draft_weights
from glm53.models.kv_cache import KVPools, OutOfPages, PageAllocator, Pool, kv_bytes_per_token, target_pools
from glm53.models.model import ForwardBatch, GlmForCausalLM, StageInput, StageOutput
from glm53.models.parallel import CommStats, TPGroup, check_tp
from glm53.models.runner import ModelRunner, SeqChunk
from glm53.models.weights import WeightError, checkpoint_tensors, fp8_param_names, load_model, load_weights

__all__ = [
    "ConfigError", "GlmConfig", "indexer_schedule",
    "KVPools", "OutOfPages", "PageAllocator", "Pool", "kv_bytes_per_token", "target_pools",
    "ForwardBatch", "GlmForCausalLM", "StageInput", "StageOutput",
    "CommStats", "TPGroup", "check_tp",
    "ModelRunner", "SeqChunk", "WeightError", "checkpoint_tensors", "fp8_param_names", "load_model", "load_weights",
    "DRAFT_KV", "DFlashConfig", "DFlashDraft", "DraftBlock", "DraftProjection", "DraftSampling", "add_draft_pools",
    "draft_kv_bytes_per_token", "build_target_layer_ids", "build_draft", "check_draft_tp", "draft_config",
    "load_draft_projection", "load_draft_weights", "write_random_draft",
]
