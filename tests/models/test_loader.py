"""The streaming loader (`weights.load_model`): the stage is built on the meta device and each
parameter allocated once, on the target device; the model is never moved whole; one checkpoint
file is open at a time; and (measured in fresh processes) the host memory a load adds does not
grow with the stage when the target is not the host, unlike the loader before it (host build,
then `.to(device)`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from torch import nn

import glm53.models.weights as weights_mod
from glm53.models import GlmConfig, GlmForCausalLM
from glm53.models.weights import checkpoint_files, load_model
from glm53.support import glm5_slice

FP8 = torch.float8_e4m3fn


def _slice(tmp_path: Path, widths: dict, layers: int, experts: int) -> Path:
    tok = tmp_path / "tok"
    tok.mkdir(exist_ok=True)
    (tok / "config.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": [299], "pad_token_id": 299}))
    out = tmp_path / "slice"
    glm5_slice.write_slice(out, layers=layers, experts=experts, vocab=320, dense_layers=1, seed=1, widths=widths,
                           tokenizer_dir=tok, fp8=True)
    return out


TINY = {"hidden_size": 192, "intermediate_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 2,
        "num_key_value_heads": 2, "q_lora_rank": 160, "kv_lora_rank": 32, "qk_nope_head_dim": 48,
        "qk_rope_head_dim": 16, "v_head_dim": 32, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8}


def test_parameters_are_built_on_meta_and_allocated_once_on_the_target(tmp_path, monkeypatch):
    ckpt = _slice(tmp_path, TINY, layers=4, experts=3)
    events: list = []

    inner_materialize = weights_mod.materialize_

    def materialize(model, device):
        # Nothing of the stage exists before this: every parameter is on the meta device.
        assert all(p.device.type == "meta" for p in model.parameters())
        events.append(("materialize", str(device)))
        inner_materialize(model, device)

    def no_move(self, *a, **kw):
        raise AssertionError("the loader moved a whole module (a host copy of the stage)")

    inner_open = weights_mod.safe_open
    open_now = {"n": 0, "max": 0, "files": []}

    class Opened:
        def __init__(self, path, *a, **kw):
            self.path, self.f = path, inner_open(path, *a, **kw)

        def __enter__(self):
            self.f.__enter__()
            open_now["n"] += 1
            open_now["max"] = max(open_now["max"], open_now["n"])
            open_now["files"].append(Path(self.path).name)
            return self.f

        def __exit__(self, *exc):
            open_now["n"] -= 1
            return self.f.__exit__(*exc)

    monkeypatch.setattr(weights_mod, "materialize_", materialize)
    monkeypatch.setattr(weights_mod, "safe_open", Opened)
    monkeypatch.setattr(nn.Module, "to", no_move)
    monkeypatch.setattr(nn.Module, "to_empty", no_move)
    model = load_model(ckpt, dtype=torch.bfloat16, device="cpu", fp8=True, progress=False)
    monkeypatch.undo()

    assert events == [("materialize", "cpu")]
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert any(p.dtype == FP8 for p in model.parameters())
    # One file at a time, each opened once (the slice: one file per layer + one for the rest).
    files = set(checkpoint_files(ckpt).values())
    assert open_now["max"] == 1 and open_now["n"] == 0
    assert sorted(open_now["files"]) == sorted(f.name for f in files)
    # The buffers built on meta were recomputed on the target, as a host-built model has them.
    ref = dict(GlmForCausalLM(GlmConfig.from_dir(ckpt), dtype=torch.bfloat16).named_buffers())
    assert set(ref) == {n for n, _ in model.named_buffers()}
    for name, b in model.named_buffers():
        assert b.device.type == "cpu" and torch.equal(b, ref[name]), name


_CHILD = textwrap.dedent("""
    import json, sys, torch
    from glm53.models import GlmConfig, GlmForCausalLM, load_weights
    from glm53.models.weights import load_model

    def status(key):  # KiB; VmHWM is this process image's peak RSS (ru_maxrss would carry the parent's over exec)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    path, loader = sys.argv[1], sys.argv[2]
    cfg = GlmConfig.from_dir(path)
    with torch.device("meta"):  # one-time costs of building a model (lazy imports), paid by both loaders
        GlmForCausalLM(cfg, dtype=torch.bfloat16)
    before = status("VmRSS")
    if loader == "stream":  # onto a device that is not the host: meta holds no memory
        model = load_model(path, dtype=torch.bfloat16, device="meta", fp8=True, progress=False)
    else:  # the loader before: the stage built and filled in host memory, then moved
        model = GlmForCausalLM(cfg, dtype=torch.bfloat16)
        load_weights(model, path, progress=False)
        model.to("meta")
    print(json.dumps({"added_kib": status("VmHWM") - before}))
""")


def _added_rss(ckpt: Path, loader: str) -> int:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(ckpt), loader], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["added_kib"] * 1024


def test_host_memory_of_a_load_does_not_grow_with_the_stage(tmp_path):
    # ~190 MB of block-FP8 weights over 7 files (one per layer, the largest ~33 MB).
    widths = {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 512, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "index_n_heads": 8,
              "index_head_dim": 128, "index_topk": 64}
    ckpt = _slice(tmp_path, widths, layers=6, experts=8)
    sizes = [f.stat().st_size for f in ckpt.glob("*.safetensors")]
    total, largest = sum(sizes), max(sizes)
    stream, host = _added_rss(ckpt, "stream"), _added_rss(ckpt, "host")
    print(f"checkpoint {total / 2**20:.0f} MiB (largest file {largest / 2**20:.0f} MiB): host RSS added by the "
          f"streaming load {stream / 2**20:.0f} MiB, by the host-built load {host / 2**20:.0f} MiB")
    # The host-built stage holds every weight in bf16 (twice the FP8 bytes) at once ...
    assert host > 1.5 * total
    # ... the streaming load one file's tensors at a time.
    assert stream < 3 * largest < total
