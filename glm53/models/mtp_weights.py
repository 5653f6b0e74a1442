"""Load GLM-5's MTP (NextN) layer from the target's checkpoint into `NextNDraft` (models/mtp.py).

Like the target's loader: built on the meta device, materialized on the device, filled tensor
by tensor (this rank's slice under TP, its experts' range under EP); block-FP8 weights are kept
e4m3 + scales where the layer can hold them, or dequantized (`fp8=False`). A checkpoint without
the layer is a `ConfigError` naming num_nextn_predict_layers (`mtp.nextn_spec`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from glm53.models.config import GlmConfig
from glm53.models.layers import materialize_
from glm53.models.model import fp8_block
from glm53.models.mtp import DEFAULT_NUM_STEPS, NextNDraft, NextNSpec, nextn_spec
from glm53.models.parallel import TPGroup
from glm53.models.sharding import shard_of
from glm53.models.weights import (FP8, CheckpointReader, WeightError, _names, checkpoint_files, checkpoint_tensors,
                                  fp8_param_names, param_of)


def build_nextn(model_dir: str | Path, cfg: GlmConfig | None = None, *, dtype: torch.dtype,
                device: torch.device | str = "cpu", tp: TPGroup | None = None, ep: int = 1, fp8: bool = False,
                embed: bool = False, num_steps: int = DEFAULT_NUM_STEPS, progress: bool = False) -> NextNDraft:
    """The MTP draft of the checkpoint in `model_dir`. `embed`: hold an embedding of its own (a
    pipeline stage without the target's; read from the layer's or else the target's tensor)."""
    model_dir = Path(model_dir)
    cfg = cfg if cfg is not None else GlmConfig.from_dir(model_dir)
    files = checkpoint_files(model_dir)
    spec = nextn_spec(cfg, files)
    prefix = f"model.layers.{spec.layer}."
    names = frozenset(n for n in fp8_param_names(cfg, files) if n.startswith(prefix)) if fp8 else frozenset()
    draft = nextn_on_meta(cfg, spec, names, dtype=dtype, tp=tp, ep=ep, embed=embed, num_steps=num_steps)
    materialize_(draft, device)
    draft.init_buffers(device)
    load_nextn_weights(draft, model_dir, files)
    return draft


def nextn_on_meta(cfg: GlmConfig, spec: NextNSpec, fp8_names: frozenset[str], *, dtype: torch.dtype,
                  tp: TPGroup | None = None, ep: int = 1, embed: bool = False,
                  num_steps: int = DEFAULT_NUM_STEPS) -> NextNDraft:
    """The draft's module on the meta device, the weights named in `fp8_names` as e4m3 + block
    scales: what a rank materializes and fills (and what `plan` counts)."""
    with torch.device("meta"):
        draft = NextNDraft(cfg, spec, dtype=dtype, tp=tp, ep=ep, embed=embed, num_steps=num_steps)
        if fp8_names:
            block = fp8_block(cfg)
            for mod_prefix, module in draft.named_modules():
                convert = getattr(module, "to_fp8", None)
                if convert is not None and mod_prefix:
                    convert(mod_prefix, fp8_names, block)
    return draft


def load_nextn_weights(draft: NextNDraft, model_dir: Path, files: dict[str, Path] | None = None) -> None:
    """Fills every parameter of `draft` from the checkpoint (this rank's part of each)."""
    files = files if files is not None else checkpoint_files(model_dir)
    params = dict(draft.named_parameters())
    wanted = [n for n in checkpoint_tensors(draft) if not n.endswith("_scale_inv") or n in files]
    source = {n: draft.checkpoint_name(n) for n in wanted}
    missing = [s for s in source.values() if s not in files]
    if missing:
        raise WeightError(f"{model_dir}: tensors missing from the checkpoint: {_names(missing)}")
    reader = CheckpointReader(files, draft.cfg)
    try:
        with torch.no_grad():
            for name, src in source.items():
                pname, e = param_of(name)
                p = params[pname]
                rule = shard_of(p)
                if e is not None and not rule.holds_expert(e):
                    continue
                dst = p if e is None else p[rule.expert_row(e)]
                have, want = reader.shape(src), rule.full_shape(dst.shape)
                if have != want:
                    raise WeightError(f"{src}: shape {have} in the checkpoint, model expects {want}")
                raw = dst.dtype == FP8 or name.endswith("_scale_inv")
                dst.copy_(reader.read(src, rule.index(have), raw=raw).to(dst.dtype))
    finally:
        reader.close()
