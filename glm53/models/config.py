"""GLM-5-family `config.json` (model_type `glm_moe_dsa`) and the DSA indexer schedule.

Every field the GLM-5 checkpoints use is read here; invalid values raise `ConfigError` naming the
field. `head_dim` is deliberately ignored: GLM-5.2 stores the nope width there, the real QK width
is `qk_nope_head_dim + qk_rope_head_dim`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)

FULL, SHARED = "full", "shared"


T = TypeVar("T")


class ConfigError(ValueError):
    """A model config value is missing or invalid; the message names the field."""


def from_config_json(model_dir: str | Path, parse: Callable[[dict[str, Any]], T]) -> T:
    """`parse` applied to `model_dir/config.json`; every error names the file."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: config.json not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from e
    try:
        return parse(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def indexer_schedule(
    num_layers: int,
    indexer_types: list[str] | None = None,
    pattern: str | list[str] | None = None,
    freq: int | None = None,
    offset: int | None = None,
) -> list[str]:
    """Per layer, "full" (runs its own indexer) or "shared" (reuses the nearest preceding full
    layer's top-k); docs/ARCHITECTURE.md, "Indexer schedule". Source of truth, in order:
    `indexer_types`, `index_topk_pattern` (F/S), else layer i (0-based) is full iff
    max(i - offset + 1, 0) % freq == 0 (freq 1, offset 2 by default)."""
    if indexer_types is not None:
        if len(indexer_types) != num_layers:
            raise ConfigError(
                f"indexer_types: has {len(indexer_types)} entries, expected num_hidden_layers={num_layers}"
            )
        bad = [t for t in indexer_types if t not in (FULL, SHARED)]
        if bad:
            raise ConfigError(f"indexer_types: entries must be 'full' or 'shared', got {bad[:3]}")
        types = list(indexer_types)
    elif pattern is not None:
        chars = list(pattern)
        if len(chars) != num_layers:
            raise ConfigError(
                f"index_topk_pattern: has {len(chars)} characters, expected num_hidden_layers={num_layers}"
            )
        if any(c not in "FS" for c in chars):
            raise ConfigError("index_topk_pattern: characters must be 'F' or 'S'")
        types = [FULL if c == "F" else SHARED for c in chars]
    else:
        freq = 1 if freq is None else freq
        offset = 2 if offset is None else offset
        if not isinstance(freq, int) or freq < 1:
            raise ConfigError(f"index_topk_freq: must be an integer >= 1, got {freq!r}")
        if not isinstance(offset, int) or offset < 0:
            raise ConfigError(f"index_skip_topk_offset: must be an integer >= 0, got {offset!r}")
        types = [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers)]
    if types and types[0] != FULL:
        raise ConfigError("indexer_types: layer 0 must be 'full' (a shared layer needs a preceding full layer)")
    return types


def indexer_source_layers(types: list[str]) -> list[int]:
    """For each layer, the full layer whose top-k it uses (itself when full)."""
    src, last = [], -1
    for i, t in enumerate(types):
        if t == FULL:
            last = i
        src.append(last)
    return src


@dataclass(frozen=True)
class GlmConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    eos_token_ids: tuple[int, ...]
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    index_share_for_mtp_iteration: bool = False
    quant_method: str | None = None
    weight_block_size: tuple[int, int] | None = None
    torch_dtype: str = "bfloat16"
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # --- derived ---
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        # GLM uses qk_head_dim^-0.5 (1/16 for GLM-5), no YaRN mscale.
        return self.qk_head_dim**-0.5

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.indexer_types) if t == FULL]

    @property
    def indexer_source(self) -> list[int]:
        return indexer_source_layers(list(self.indexer_types))

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "GlmConfig":
        return from_config_json(model_dir, cls.from_dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GlmConfig":
        def get(name: str, typ: type | tuple, default: Any = ..., minimum: float | None = None) -> Any:
            if name not in d or d[name] is None:
                if default is ...:
                    raise ConfigError(f"{name}: required field is missing")
                return default
            v = d[name]
            types = typ if isinstance(typ, tuple) else (typ,)
            if isinstance(v, bool) and bool not in types:
                raise ConfigError(f"{name}: expected {'/'.join(t.__name__ for t in types)}, got {v!r}")
            if float in types and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, types):
                raise ConfigError(f"{name}: expected {'/'.join(t.__name__ for t in types)}, got {v!r}")
            if minimum is not None and v < minimum:
                raise ConfigError(f"{name}: must be >= {minimum}, got {v!r}")
            return v

        model_type = d.get("model_type")
        if model_type not in (None, "glm_moe_dsa"):
            raise ConfigError(f"model_type: expected 'glm_moe_dsa', got {model_type!r}")
        if get("hidden_act", str, "silu") != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is supported, got {d['hidden_act']!r}")
        if get("scoring_func", str, "sigmoid") != "sigmoid":
            raise ConfigError(f"scoring_func: only 'sigmoid' is supported, got {d['scoring_func']!r}")
        if get("topk_method", str, "noaux_tc") != "noaux_tc":
            raise ConfigError(f"topk_method: only 'noaux_tc' is supported, got {d['topk_method']!r}")
        if get("attention_bias", bool, False):
            raise ConfigError("attention_bias: GLM-5 has no attention bias; true is not supported")

        L = get("num_hidden_layers", int, minimum=1)
        heads = get("num_attention_heads", int, minimum=1)
        kv_heads = get("num_key_value_heads", int, heads)
        if kv_heads != heads:
            raise ConfigError(f"num_key_value_heads: MLA needs it equal to num_attention_heads ({heads}), got {kv_heads}")
        rope_dim = get("qk_rope_head_dim", int, minimum=2)
        if rope_dim % 2:
            raise ConfigError(f"qk_rope_head_dim: must be even, got {rope_dim}")
        index_head_dim = get("index_head_dim", int, 128, minimum=1)
        if index_head_dim < rope_dim:
            raise ConfigError(f"index_head_dim: must be >= qk_rope_head_dim ({rope_dim}), got {index_head_dim}")

        # RoPE: `rope_parameters` (transformers 5) or the legacy `rope_theta` / `rope_scaling`.
        rp = d.get("rope_parameters")
        if rp is not None and not isinstance(rp, dict):
            raise ConfigError(f"rope_parameters: expected an object, got {rp!r}")
        rp = dict(rp or {})
        if d.get("rope_scaling"):
            rp.update(d["rope_scaling"])
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type: only 'default' RoPE is supported (GLM-5 family), got {rope_type!r}")
        theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ConfigError(f"rope_parameters.rope_theta: must be a positive number, got {theta!r}")

        types = indexer_schedule(
            L,
            indexer_types=d.get("indexer_types"),
            pattern=d.get("index_topk_pattern"),
            freq=d.get("index_topk_freq"),
            offset=d.get("index_skip_topk_offset"),
        )

        n_experts = get("n_routed_experts", int, minimum=1)
        first_dense = get("first_k_dense_replace", int, 0, minimum=0)
        moe_freq = get("moe_layer_freq", int, 1, minimum=1)
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            mlp_types = ["sparse" if (i >= first_dense and i % moe_freq == 0) else "dense" for i in range(L)]
        elif len(mlp_types) != L or any(t not in ("dense", "sparse") for t in mlp_types):
            raise ConfigError(f"mlp_layer_types: expected {L} entries of 'dense'/'sparse'")
        n_group = get("n_group", int, 1, minimum=1)
        topk_group = get("topk_group", int, 1, minimum=1)
        if n_experts % n_group:
            raise ConfigError(f"n_group: n_routed_experts ({n_experts}) must be divisible by n_group ({n_group})")
        if topk_group > n_group:
            raise ConfigError(f"topk_group: must be <= n_group ({n_group}), got {topk_group}")
        if n_group > 1 and n_experts // n_group < 2:
            raise ConfigError("n_group: group-limited routing needs >= 2 experts per group")
        top_k = get("num_experts_per_tok", int, minimum=1)
        if top_k > (n_experts // n_group) * topk_group:
            raise ConfigError(
                f"num_experts_per_tok: {top_k} exceeds the experts reachable in topk_group groups"
            )

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if any(not isinstance(e, int) or isinstance(e, bool) for e in eos_ids):
            raise ConfigError(f"eos_token_id: expected an integer or a list of integers, got {eos!r}")

        q = d.get("quantization_config") or {}
        if not isinstance(q, dict):
            raise ConfigError("quantization_config: expected an object")
        quant = q.get("quant_method")
        if quant not in (None, "fp8"):
            raise ConfigError(f"quantization_config.quant_method: only 'fp8' (block) is supported, got {quant!r}")
        block = q.get("weight_block_size")
        if quant == "fp8" and (not isinstance(block, list) or len(block) != 2):
            raise ConfigError("quantization_config.weight_block_size: expected [rows, cols] for fp8")

        vocab = get("vocab_size", int, minimum=1)
        if any(not 0 <= e < vocab for e in eos_ids):
            raise ConfigError(f"eos_token_id: ids must be < vocab_size ({vocab}), got {list(eos_ids)}")
        cfg = cls(
            vocab_size=vocab,
            hidden_size=get("hidden_size", int, minimum=1),
            intermediate_size=get("intermediate_size", int, minimum=1),
            moe_intermediate_size=get("moe_intermediate_size", int, minimum=1),
            num_hidden_layers=L,
            num_attention_heads=heads,
            q_lora_rank=get("q_lora_rank", int, minimum=1),
            kv_lora_rank=get("kv_lora_rank", int, minimum=1),
            qk_nope_head_dim=get("qk_nope_head_dim", int, minimum=1),
            qk_rope_head_dim=rope_dim,
            v_head_dim=get("v_head_dim", int, minimum=1),
            index_n_heads=get("index_n_heads", int, 32, minimum=1),
            index_head_dim=index_head_dim,
            index_topk=get("index_topk", int, 2048, minimum=1),
            indexer_types=tuple(types),
            mlp_layer_types=tuple(mlp_types),
            n_routed_experts=n_experts,
            num_experts_per_tok=top_k,
            n_shared_experts=get("n_shared_experts", int, 0, minimum=0),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=get("norm_topk_prob", bool, True),
            routed_scaling_factor=get("routed_scaling_factor", float, 1.0, minimum=0),
            rope_theta=float(theta),
            max_position_embeddings=get("max_position_embeddings", int, 202752, minimum=1),
            rms_norm_eps=get("rms_norm_eps", float, 1e-5, minimum=0),
            eos_token_ids=eos_ids,
            rope_interleave=get("rope_interleave", bool, True),
            indexer_rope_interleave=get("indexer_rope_interleave", bool, True),
            num_nextn_predict_layers=get("num_nextn_predict_layers", int, 0, minimum=0),
            tie_word_embeddings=get("tie_word_embeddings", bool, False),
            pad_token_id=d.get("pad_token_id"),
            bos_token_id=d.get("bos_token_id"),
            index_share_for_mtp_iteration=get("index_share_for_mtp_iteration", bool, False),
            quant_method=quant,
            weight_block_size=tuple(block) if quant == "fp8" else None,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            raw=dict(d),
        )
        return cfg
