"""The DFlash draft's `config.json` (z-lab `DFlashDraftModel` layout: Qwen3-style decoder dims
plus a `dflash_config` object, or a DSpark draft's `dspark_config`), validated against the
target it drafts for.

Every invalid or ill-fitting value raises `ConfigError` naming the field. The draft has no
embeddings or LM head; it reads the target's layers `target_layer_ids` (feature k = output of
target layer `target_layer_ids[k]`, docs/ARCHITECTURE.md "Capture and partial projection").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm53.models.config import ConfigError, GlmConfig, from_config_json

DEFAULT_BLOCK_SIZE = 16


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default: one draft layer reads the middle target layer; n > 1 read layers
    spread evenly from 1 to L - 3. A target too shallow for n distinct layers there (L < n + 3:
    the published formula would repeat or reverse them) gets n layers spread over all of [0, L)."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    if n > L:
        raise ConfigError(f"target_layer_ids: a {n}-layer draft reads {n} distinct target layers by default; "
                          f"the target has {L} (set dflash_config.target_layer_ids)")
    start, end = (1, L - 3) if L - 3 - 1 >= n - 1 else (0, L - 1)
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    torch_dtype: str = "bfloat16"
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # DSpark heads (models/dspark.py), known from the checkpoint's tensors, not its config.json
    # (draft_weights.draft_config): the Markov head's rank r (0: a plain DFlash draft) and
    # whether a confidence head is there.
    markov_rank: int = 0
    confidence_head: bool = False

    @property
    def algorithm(self) -> str:
        """"DSPARK" for a draft with a Markov head, else "DFLASH"."""
        return "DSPARK" if self.markov_rank else "DFLASH"

    @property
    def num_features(self) -> int:
        """K: how many target layers feed `fc` (may differ from the draft's depth)."""
        return len(self.target_layer_ids)

    @property
    def draft_layers(self) -> tuple[int, ...]:
        """The draft's own layer ids, which name the layers of its KV pool."""
        return tuple(range(self.num_hidden_layers))

    @classmethod
    def from_dir(cls, path: str | Path, target: GlmConfig) -> "DFlashConfig":
        return from_config_json(path, lambda d: cls.from_dict(d, target))

    @classmethod
    def from_dict(cls, d: dict[str, Any], target: GlmConfig) -> "DFlashConfig":
        # A DSpark checkpoint may carry a `dspark_config` section (same fields; it wins over
        # `dflash_config` where both name one).
        dd: dict[str, Any] = {}
        sec = "dflash_config"
        for name in ("dflash_config", "dspark_config"):
            part = d.get(name) or {}
            if not isinstance(part, dict):
                raise ConfigError(f"{name}: expected an object, got {part!r}")
            if part:
                dd, sec = {**dd, **part}, name

        def get(name: str, typ: type, default: Any = ..., minimum: float | None = None, src: dict = d) -> Any:
            where = name if src is d else f"{sec}.{name}"
            if name not in src or src[name] is None:
                if default is ...:
                    raise ConfigError(f"{where}: required field is missing")
                return default
            v = src[name]
            if typ is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if isinstance(v, bool) or not isinstance(v, typ):
                raise ConfigError(f"{where}: expected {typ.__name__}, got {v!r}")
            if minimum is not None and v < minimum:
                raise ConfigError(f"{where}: must be >= {minimum}, got {v!r}")
            return v

        if get("hidden_act", str, "silu") != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is supported, got {d['hidden_act']!r}")
        if d.get("attention_bias"):
            raise ConfigError("attention_bias: the DFlash draft has no attention bias; true is not supported")
        types = d.get("layer_types")
        if types is not None and any(t != "full_attention" for t in types):
            raise ConfigError(f"layer_types: only 'full_attention' draft layers are supported, got {types}")

        hidden = get("hidden_size", int, minimum=1)
        if hidden != target.hidden_size:
            raise ConfigError(f"hidden_size: the draft's {hidden} differs from the target's {target.hidden_size}")
        n_layers = get("num_hidden_layers", int, minimum=1)
        heads = get("num_attention_heads", int, minimum=1)
        kv_heads = get("num_key_value_heads", int, heads, minimum=1)
        if heads % kv_heads:
            raise ConfigError(f"num_key_value_heads: {kv_heads} does not divide num_attention_heads={heads}")
        head_dim = get("head_dim", int, hidden // heads, minimum=2)
        if head_dim % 2:
            raise ConfigError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")

        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rp, dict):
            raise ConfigError(f"rope_parameters: expected an object, got {rp!r}")
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type: only 'default' RoPE is supported, got {rope_type!r}")
        theta = rp.get("rope_theta", d.get("rope_theta", 10000.0))
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
            raise ConfigError(f"rope_theta: must be a positive number, got {theta!r}")

        # block_size: top level or in the draft's section (the latter wins when both are set).
        block = get("block_size", int, None, minimum=2, src=dd)
        if block is None:
            block = get("block_size", int, DEFAULT_BLOCK_SIZE, minimum=2)

        L = target.num_hidden_layers
        n_target = d.get("num_target_layers", dd.get("num_target_layers"))
        if n_target is not None and n_target != L:
            raise ConfigError(f"num_target_layers: the draft was built for {n_target} target layers, the target has {L}")
        ids = dd.get("target_layer_ids")
        if ids is None:
            ids = build_target_layer_ids(L, n_layers)
        elif not isinstance(ids, list) or not ids or any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
            raise ConfigError(f"{sec}.target_layer_ids: expected a non-empty list of integers, got {ids!r}")
        bad = [i for i in ids if not 0 <= i < L]
        if bad:
            raise ConfigError(f"{sec}.target_layer_ids: {bad} outside the target's layers [0, {L})")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise ConfigError(f"{sec}.target_layer_ids: must be strictly increasing, got {ids}")

        mask = dd.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise ConfigError(f"{sec}.mask_token_id: required field is missing")
        if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < target.vocab_size:
            raise ConfigError(
                f"{sec}.mask_token_id: must be an id in the target's vocabulary [0, {target.vocab_size}), got {mask!r}"
            )

        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=get("intermediate_size", int, minimum=1),
            rms_norm_eps=get("rms_norm_eps", float, 1e-6, minimum=0),
            rope_theta=float(theta),
            block_size=block,
            target_layer_ids=tuple(ids),
            mask_token_id=mask,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            raw=dict(d),
        )


def check_draft_tp(cfg: DFlashConfig, tp: int) -> None:
    """Raises `ConfigError` naming the first draft dimension `tp` ranks cannot split: the KV
    heads (each rank holds whole K/V heads and their query groups; the query heads then divide
    too) and the MLP width. `fc` and the norms are replicated."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tensor_parallel_size: must be an integer >= 1, got {tp!r}")
    for name, value in (("num_key_value_heads", cfg.num_key_value_heads), ("intermediate_size", cfg.intermediate_size)):
        if value % tp:
            raise ConfigError(f"draft {name}: {value} is not divisible by tensor_parallel_size={tp}")
