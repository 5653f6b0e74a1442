"""Write a GLM-5-shaped slice checkpoint: GLM-5's full attention and indexer widths, few layers and
experts, random weights, in the Hugging Face layout `glm53.models.load_weights` reads.

    PYTHONPATH=. python tools/make_slice.py OUT_DIR [--layers 4] [--experts 16] [--vocab V] [--fp8] ...
    PYTHONPATH=. python -m glm53.support.glm5_slice OUT_DIR ...   # the same (this module's `main`)

Widths are GLM-5's (`tests/models/glm5_config.py`, GLM5): hidden 6144, 64 heads, q_lora 2048,
kv_lora 512, qk_nope 192 + qk_rope 64, v_head 256, indexer 32 heads x 128 with index_topk 2048,
index sharing every 4th layer from offset 3 (GLM-5.2's schedule: layers 0-2 full, then one full
layer in four), routed experts of width 2048 with top-8 and one shared expert. Layers, routed
experts, dense leading layers and the vocabulary are arguments. `--layers 4 --experts 16
--dense-layers 1` is the slice of issue 16 (about 2.9 B parameters with the default vocabulary).

The tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja) and the eos/pad ids
are copied from a tokenizer source directory, by default the embedded tiny model's (created on
first use, nothing downloaded), so the slice serves through `glm53-serve` like any checkpoint;
the vocabulary must cover that tokenizer. The weights are fan-in-scaled Gaussians drawn layer by
layer and written one safetensors shard per layer (+ one for embeddings/head), so writing never
holds more than one layer in memory.

`--fp8` writes the GLM-5-FP8 layout: block-FP8 (e4m3 `<name>.weight` + fp32
`<name>.weight_scale_inv` [ceil(N/128), ceil(K/128)], `kernels.fp8_quant.quantize_fp8_blocks`)
exactly where the released GLM-5-FP8 checkpoint has it (`fp8_in_glm5`), the rest in `--dtype`,
and config.json's `quantization_config` as the release has it (`FP8_QUANTIZATION_CONFIG`). The
weights are the same draws as the plain slice's of the same seed, quantized.

`widths` (Python API) or `--width KEY=VALUE` override any config field; the unit test uses it to
write a tiny-width slice through the same code. `ensure_slice` writes issue 16's slice unless it
exists (the GPU benchmarks); benchmarks/fp8_kv.py draws the same slice on the GPU from
`slice_config`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from glm53.models.weights import fp8_in_glm5

# GLM-5's attention, indexer and expert widths (config.json field names, models/config.py)
GLM5_WIDTHS: dict[str, Any] = {
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_skip_topk_offset": 3,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 202752,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# GLM-5-FP8's `quantization_config` (the DeepSeek-V3 block-FP8 format).
FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def slice_config(layers: int, experts: int, vocab: int, dense_layers: int = 1,
                 eos_token_id: list[int] | None = None, pad_token_id: int | None = None,
                 widths: dict[str, Any] | None = None, dtype: str = "bfloat16", fp8: bool = False) -> dict[str, Any]:
    """The slice's config.json. top-k is GLM-5's 8, or every expert when there are fewer. `fp8`:
    with GLM-5-FP8's `quantization_config`."""
    w = {**GLM5_WIDTHS, **(widths or {})}
    if "num_experts_per_tok" not in (widths or {}):
        w["num_experts_per_tok"] = min(w["num_experts_per_tok"], experts)
    freq, offset = w["index_topk_freq"], w["index_skip_topk_offset"]
    quant = {"quantization_config": dict(FP8_QUANTIZATION_CONFIG)} if fp8 else {}
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "attention_bias": False,
        "dtype": dtype,
        "eos_token_id": eos_token_id or [],
        "pad_token_id": pad_token_id,
        "first_k_dense_replace": dense_layers,
        "moe_layer_freq": 1,
        "head_dim": w["qk_nope_head_dim"],  # GLM-5.2 stores the nope width here (ignored by the loader)
        "hidden_act": "silu",
        "indexer_types": ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)],
        "indexer_rope_interleave": True,
        "rope_interleave": True,
        "n_routed_experts": experts,
        "norm_topk_prob": True,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 0,
        "qk_head_dim": w["qk_nope_head_dim"] + w["qk_rope_head_dim"],
        "rms_norm_eps": 1e-5,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "vocab_size": vocab,
        **quant,
        **w,
    }


def default_tokenizer_dir() -> Path:
    from glm53.server.embedded_model import ensure_embedded_model

    return ensure_embedded_model()


def _init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Fan-in scaled, as the embedded model draws its weights (activations stay O(1) through the
    layers, logits spread by a few units)."""
    if name.endswith(("norm.weight", "layernorm.weight")):
        return 1.0 + 0.05 * torch.randn(shape, generator=g)
    if name.endswith(("k_norm.bias", "e_score_correction_bias")):
        return 0.05 * torch.randn(shape, generator=g)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=g)
    if name == "lm_head.weight":
        return 4.0 * torch.randn(shape, generator=g) / shape[1] ** 0.5
    return torch.randn(shape, generator=g) / shape[-1] ** 0.5


def tensor_specs(cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every checkpoint tensor: name -> (shape, dtype), read off the model built on the meta device
    (so names and shapes are exactly what the loader expects). The router's correction bias is
    stored in fp32, as GLM-5 ships it."""
    from glm53.models.config import GlmConfig
    from glm53.models.model import GlmForCausalLM
    from glm53.models.weights import checkpoint_tensors

    with torch.device("meta"):
        model = GlmForCausalLM(GlmConfig.from_dict(cfg), dtype=dtype)
    return {name: (shape, torch.float32 if name.endswith("e_score_correction_bias") else dtype)
            for name, (shape, _) in checkpoint_tensors(model).items()}


def write_slice(out: str | Path, layers: int = 4, experts: int = 16, vocab: int | None = None,
                dense_layers: int = 1, seed: int = 0, dtype: str = "bfloat16",
                widths: dict[str, Any] | None = None, tokenizer_dir: str | Path | None = None,
                log=None, fp8: bool = False) -> Path:
    """Write the slice into `out` (created) and return it; `fp8`: in the GLM-5-FP8 layout."""
    from safetensors.torch import save_file

    from glm53.kernels.fp8_quant import quantize_fp8_blocks

    out = Path(out)
    tok_dir = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_dir()
    tok_cfg = json.loads((tok_dir / "config.json").read_text())
    tok_vocab = tok_cfg["vocab_size"]
    vocab = tok_vocab if vocab is None else vocab
    if vocab < tok_vocab:
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's vocabulary ({tok_vocab}, {tok_dir})")
    if not 0 <= dense_layers <= layers:
        raise ValueError(f"dense_layers must be in [0, layers={layers}], got {dense_layers}")
    eos = tok_cfg.get("eos_token_id")
    cfg = slice_config(layers, experts, vocab, dense_layers, eos if isinstance(eos, list) else [eos],
                       tok_cfg.get("pad_token_id"), widths, dtype, fp8)
    specs = tensor_specs(cfg, DTYPES[dtype])

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]}, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (tok_dir / f).is_file():
            shutil.copyfile(tok_dir / f, out / f)

    # one shard per decoder layer, one for the rest (embeddings, final norm, lm_head)
    groups: dict[str, list[str]] = {}
    for name in specs:
        m = _LAYER.match(name)
        groups.setdefault(f"layer{int(m.group(1)):03d}" if m else "rest", []).append(name)
    keys = sorted(groups)
    weight_map: dict[str, str] = {}
    total = 0
    g = torch.Generator().manual_seed(seed)
    for i, key in enumerate(keys):
        fname = f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors"
        tensors = {}
        for name in groups[key]:
            shape, dt = specs[name]
            w = _init(name, shape, g)
            if fp8 and fp8_in_glm5(name):
                tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(w)
                weight_map[name + "_scale_inv"] = fname
                total += tensors[name + "_scale_inv"].numel() * 4
            else:
                tensors[name] = w.to(dt).contiguous()
            del w
            weight_map[name] = fname
            total += tensors[name].numel() * tensors[name].element_size()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
        if log:
            log(f"wrote {fname} ({key})")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    return out


def ensure_slice(slice_dir: Path, fp8: bool = False) -> Path:
    """Issue 16's GLM-5-shaped slice (4 layers, 16 experts, 1 dense), written unless it exists;
    `fp8`: in the GLM-5-FP8 layout (issue 29's FP8 slice)."""
    if not (slice_dir / "config.json").exists():
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "glm53.support.glm5_slice", str(slice_dir), "--layers", "4",
                        "--experts", "16", "--dense-layers", "1", *(["--fp8"] if fp8 else [])], check=True)
        print(f"slice written in {time.monotonic() - t0:.0f} s", flush=True)
    return slice_dir


def parameter_count(cfg: dict[str, Any]) -> int:
    n = 0
    for shape, _ in tensor_specs(cfg, torch.bfloat16).values():
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


def _width(s: str) -> tuple[str, Any]:
    k, _, v = s.partition("=")
    if not k or not v:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    return k, json.loads(v)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer")
    ap.add_argument("--dense-layers", type=int, default=1, help="leading dense-MLP layers (first_k_dense_replace)")
    ap.add_argument("--vocab", type=int, default=None, help="default: the tokenizer's vocabulary")
    ap.add_argument("--tokenizer-from", default=None, help="a model directory to copy the tokenizer and eos "
                    "ids from (default: the embedded tiny model)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fp8", action="store_true", help="the GLM-5-FP8 layout: block-FP8 weights (e4m3 + "
                    "weight_scale_inv per 128x128 block) where the released checkpoint has them")
    ap.add_argument("--width", type=_width, action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field (JSON value), e.g. --width hidden_size=1024")
    a = ap.parse_args(argv)
    out = write_slice(a.out_dir, a.layers, a.experts, a.vocab, a.dense_layers, a.seed, a.dtype,
                      dict(a.width), a.tokenizer_from, log=lambda s: print(s, file=sys.stderr), fp8=a.fp8)
    cfg = json.loads((out / "config.json").read_text())
    print(f"{out}: {a.layers} layers, {a.experts} experts, vocab {cfg['vocab_size']}, "
          f"{parameter_count(cfg) / 1e9:.2f} B parameters{', block-FP8' if a.fp8 else ''}")


if __name__ == "__main__":
    main()
