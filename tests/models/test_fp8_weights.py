"""Block-FP8 weights kept FP8 (issue 29): an oracle checkpoint quantized in the GLM-5-FP8 layout
(128×128 blocks, glm53.support.oracle.quantise_fp8_) loaded with its FP8 weights e4m3 + scales
against the same checkpoint dequantized at load, on fresh random weights every run; which
parameters are FP8, their bits and scales; tensor parallelism (tp = 2 ranks over gloo against
tp = 1, and the block rule GLM-5's widths allow); `checkpoint_tensors` round trip; the
GLM-5-FP8 slice writer (`glm5_slice --fp8`)."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import glm53.models.layers as layers_mod
import glm53.models.moe as moe_mod
from glm53.kernels.fp8_quant import dequantize_fp8_blocks
from glm53.models import ConfigError, GlmConfig, GlmForCausalLM, ModelRunner, check_tp
from glm53.models.sharding import shard_of
from glm53.models.weights import checkpoint_tensors, fp8_param_names, load_model, param_of
from glm53.support import glm5_slice
from glm53.support.oracle import FP8_WIDTHS, make_checkpoint, quantise_fp8_
from tests.models.glm5_config import GLM5
from tests.models.tp_harness import PAGE, PAGES, ReadRecorder, greedy, run_ranks, scenario

FP8 = torch.float8_e4m3fn
SCALE = "_scale_inv"
FP32_BY_DESIGN = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")


def _seed() -> int:
    seed = random.randrange(2**31)
    print(f"checkpoint seed {seed}")
    return seed


def _fp8_checkpoint(path: Path, seed: int) -> Path:
    make_checkpoint(path, seed=seed, **FP8_WIDTHS)
    quantise_fp8_(path, block=128)
    return path


def _value(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The model's tensor for checkpoint tensor `name` (a stacked expert's row)."""
    pname, e = param_of(name)
    return params[pname] if e is None else params[pname][e]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == FP8 or b.dtype == FP8:
        return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _kv_b(names) -> set[str]:
    return {n for n in names if ".kv_b_proj." in n}


def test_fp8_model_equals_the_dequantized_model(tmp_path, monkeypatch):
    ckpt = _fp8_checkpoint(tmp_path, _seed())
    fp8 = ModelRunner.from_dir(ckpt, page_size=PAGE, num_pages=PAGES, progress=False, fp8=True)
    deq = ModelRunner.from_dir(ckpt, page_size=PAGE, num_pages=PAGES, progress=False)
    assert fp8.model.fp8_params and not deq.model.fp8_params

    calls = {"gemm": 0, "moe": 0}

    def counted(key, fn):
        def wrap(*a, **kw):
            calls[key] += 1
            return fn(*a, **kw)
        return wrap

    monkeypatch.setattr(layers_mod, "fp8_gemm", counted("gemm", layers_mod.fp8_gemm))
    monkeypatch.setattr(moe_mod, "moe_experts_fp8", counted("moe", moe_mod.moe_experts_fp8))
    a = scenario(fp8, greedy)
    gemm, moe = calls["gemm"], calls["moe"]
    assert gemm > 0 and moe > 0  # the FP8 forward ran the FP8 products
    b = scenario(deq, greedy)
    assert calls == {"gemm": gemm, "moe": moe}  # and the dequantized one none

    # Chunked prefill of prompts 3-7x index_topk, then batched decode: the same bits in fp32.
    assert a["tokens"] == b["tokens"]
    assert len(a["logits"]) == len(b["logits"]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a["logits"], b["logits"]))
    assert len(a["topk"]) == len(b["topk"]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a["topk"], b["topk"]))


def test_fp8_params_are_e4m3_where_the_checkpoint_is_and_the_rest_bf16(tmp_path):
    ckpt = _fp8_checkpoint(tmp_path, _seed())
    model = load_model(ckpt, dtype=torch.bfloat16, fp8=True, progress=False)
    sd = load_file(str(ckpt / "model.safetensors"))
    cfg = model.cfg
    scales = {n for n in sd if n.endswith(SCALE)}
    fp8_weights = {n[: -len(SCALE)] for n in scales}
    assert fp8_weights == {n for n in sd if glm5_slice.fp8_in_glm5(n)}  # the GLM-5-FP8 layout

    params = dict(model.named_parameters())
    e4m3 = {n: p for n, p in params.items() if p.dtype == FP8}
    # Every FP8 checkpoint weight is an e4m3 parameter (a stacked one counts once per expert) or
    # kv_b_proj, held dequantized for the absorbed attention (one per layer).
    per_tensor = sum(p.shape[0] if n.endswith("_proj") else 1 for n, p in e4m3.items())
    assert per_tensor + cfg.num_hidden_layers == len(scales)
    assert set(e4m3) == set(model.fp8_params)
    assert model.fp8_dequantized == {f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in range(cfg.num_hidden_layers)}

    for name, (shape, dtype) in checkpoint_tensors(model).items():
        t, v = sd[name], _value(params, name)
        assert tuple(v.shape) == tuple(t.shape) or shard_of(params[param_of(name)[0]]).replicated
        if name.endswith(SCALE):
            assert v.dtype == torch.float32 and torch.equal(v, t), name
        elif name in fp8_weights and ".kv_b_proj." not in name:
            assert _bits_equal(v, t), name  # as stored: e4m3, no rounding
        elif name in fp8_weights:  # kv_b_proj: dequantized once at load, to the model dtype
            assert v.dtype == torch.bfloat16
            assert torch.equal(v, dequantize_fp8_blocks(t, sd[name + SCALE], dtype=torch.bfloat16)), name
        else:
            want = torch.float32 if name.endswith(FP32_BY_DESIGN) else torch.bfloat16
            assert v.dtype == want and torch.equal(v, t.to(want)), name
    # The model lists no scale for kv_b_proj and every other one.
    assert {n for n in checkpoint_tensors(model) if n.endswith(SCALE)} == scales - {n + SCALE for n in _kv_b(fp8_weights)}

    # dtype bfloat16 with FP8 off dequantizes everything at load, as before.
    deq = load_model(ckpt, dtype=torch.bfloat16, fp8=False, progress=False)
    assert not any(p.dtype == FP8 for p in deq.parameters()) and not deq.fp8_params
    w = dict(deq.named_parameters())["model.layers.1.self_attn.o_proj.weight"]
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(w, dequantize_fp8_blocks(sd[name], sd[name + SCALE], dtype=torch.bfloat16))


def test_checkpoint_tensors_round_trip_fp8(tmp_path):
    ckpt = _fp8_checkpoint(tmp_path / "ckpt", _seed())
    sd = load_file(str(ckpt / "model.safetensors"))
    cfg = GlmConfig.from_dir(ckpt)
    model = load_model(ckpt, dtype=torch.float32, fp8=True, progress=False)
    listed = checkpoint_tensors(model)
    # On the meta device, from the checkpoint's names alone: the same list.
    with torch.device("meta"):
        meta = GlmForCausalLM(cfg, fp8=fp8_param_names(cfg, sd))
    assert list(checkpoint_tensors(meta).items()) == list(listed.items())
    # The checkpoint's tensors, each FP8 weight followed by its scale, but kv_b_proj's scale: the
    # model holds kv_b_proj dequantized (fp32 here) and lists it so.
    kv_b_scales = {n + SCALE for n in _kv_b(sd) if not n.endswith(SCALE)}
    assert set(listed) == set(sd) - kv_b_scales
    names = list(listed)
    for i, n in enumerate(names):
        if n.endswith(SCALE):
            assert names[i - 1] == n[: -len(SCALE)]
        want = torch.float32 if ".kv_b_proj." in n else sd[n].dtype
        assert listed[n] == (tuple(sd[n].shape), want), n

    # Written from the model under those names, the checkpoint loads back bit for bit.
    params = dict(model.named_parameters())
    out = tmp_path / "written"
    out.mkdir()
    save_file({n: _value(params, n).contiguous() for n in listed}, str(out / "model.safetensors"))
    shutil.copyfile(ckpt / "config.json", out / "config.json")
    again = load_model(out, dtype=torch.float32, fp8=True, progress=False)
    assert again.fp8_params == model.fp8_params and not again.fp8_dequantized
    back = dict(again.named_parameters())
    assert set(back) == set(params)
    for n, p in params.items():
        assert _bits_equal(back[n], p), n


def test_a_stack_fp8_for_some_experts_only_is_dequantized(tmp_path):
    ckpt = _fp8_checkpoint(tmp_path, _seed())
    sd = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    sd[name] = dequantize_fp8_blocks(sd[name], sd.pop(name + SCALE))  # one expert's tensor in fp32
    save_file(sd, str(ckpt / "model.safetensors"))
    cfg = GlmConfig.from_dir(ckpt)
    names = fp8_param_names(cfg, sd)
    assert "model.layers.2.mlp.experts.up_proj" not in names and "model.layers.2.mlp.experts.gate_proj" in names
    fp8 = ModelRunner.from_dir(ckpt, page_size=PAGE, num_pages=PAGES, progress=False, fp8=True)
    experts = fp8.model.model.layers["2"].mlp.experts
    assert not experts.fp8 and experts.gate_proj.dtype == torch.float32  # one form for the three stacks
    assert "model.layers.2.mlp.experts.gate_proj" in fp8.model.fp8_dequantized
    assert fp8.model.model.layers["1"].mlp.experts.fp8
    deq = ModelRunner.from_dir(ckpt, page_size=PAGE, num_pages=PAGES, progress=False)
    a, b = scenario(fp8, greedy), scenario(deq, greedy)
    assert all(torch.equal(x, y) for x, y in zip(a["logits"], b["logits"]))


def _rules(model: torch.nn.Module, names) -> dict:
    params = dict(model.named_parameters())
    return {n: shard_of(params[param_of(n)[0]]) for n in names}


def _rank_fp8(tp, ckpt: str, out: str, tokens: list[list[int]]) -> None:
    with ReadRecorder() as rec:
        runner = ModelRunner.from_dir(ckpt, page_size=PAGE, num_pages=PAGES, progress=False, tp=tp, fp8=True)
    model = runner.model
    listed = checkpoint_tensors(model)
    rules = _rules(model, listed)
    sd = load_file(str(Path(ckpt) / "model.safetensors"))
    # Every tensor the model holds is read once: split ones (FP8 scales with their own rule) as this
    # rank's part only, replicated ones whole; kv_b_proj's scale blocks for its dequantized part.
    reads = {}
    for name, shape, whole in rec.reads:
        assert name not in reads, f"{name} read twice"
        reads[name] = (shape, whole)
    assert set(reads) - set(listed) == {n + "_scale_inv" for n in _kv_b(listed)}
    split_scales = 0
    params = dict(model.named_parameters())
    for name, (full, _) in listed.items():
        rule = rules[name]
        shape, whole = reads[name]
        if rule.replicated:
            assert whole and shape == full, name
        else:
            assert not whole and shape == rule.local_shape(full) != full, f"{name}: read {shape} of {full}"
            split_scales += name.endswith(SCALE)
        # The values: this rank's part of the checkpoint tensor, FP8 bits as stored.
        v, t = _value(params, name), sd[name]
        idx = rule.index(tuple(t.shape))
        if ".kv_b_proj." in name:
            t = dequantize_fp8_blocks(t, sd[name + SCALE])
        part = t if idx is None else t[idx]
        assert _bits_equal(v, part.to(v.dtype) if v.dtype != FP8 else part), name
    assert split_scales > 0  # q_b_proj, o_proj, the MLPs' and experts' scales are split

    # A tp whose parts cut 128-blocks is refused before anything is built, naming the layer and tp.
    cfg = GlmConfig.from_dir(ckpt)
    narrow = GlmConfig.from_dict({**cfg.raw, "moe_intermediate_size": 128})
    names = fp8_param_names(narrow, sd)
    with pytest.raises(ConfigError, match=r"model\.layers\.\d+\.mlp\.(experts|shared_experts)\.\S+: "
                                          r"tensor_parallel_size=2 .*parts of 64"):
        with torch.device("meta"):
            GlmForCausalLM(narrow, tp=tp, fp8=names)

    it = iter(tokens)
    res = scenario(runner, lambda rows: next(it))  # the reference's tokens (teacher forcing)

    # Expert parallelism (ep = tp = 2): each rank reads only its half of the experts, FP8 as stored,
    # with their scales, and runs them through the all-to-all.
    with ReadRecorder() as rec:
        ep_model = load_model(ckpt, dtype=torch.float32, tp=tp, ep=2, fp8=True, progress=False)
    experts = ep_model.model.layers["1"].mlp.experts
    assert experts.fp8 and experts.gate_proj.shape[0] == model.cfg.n_routed_experts // 2
    read = {n for n, _, _ in rec.reads if ".mlp.experts." in n}
    assert read and all(int(n.split(".")[5]) in experts.placement.experts for n in read)
    assert any(n.endswith(SCALE) for n in read)
    it = iter(tokens)
    ep_res = scenario(ModelRunner(ep_model, num_pages=PAGES, page_size=PAGE), lambda rows: next(it))
    torch.save({**res, "ep_logits": ep_res["logits"]}, Path(out) / f"rank{tp.rank}.pt")


def test_tp2_fp8_shards_equal_tp1(tmp_path):
    ckpt = _fp8_checkpoint(tmp_path / "ckpt", _seed())
    single = ModelRunner.from_dir(ckpt, page_size=PAGE, num_pages=PAGES, progress=False, fp8=True)
    assert single.model.fp8_params
    ref = scenario(single, greedy)
    run_ranks(2, _rank_fp8, str(ckpt), str(tmp_path), ref["tokens"])
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    err = max(float((a - b).abs().max()) for a, b in zip(ranks[0]["logits"], ref["logits"]))
    print(f"tp=2 FP8: max |logit error| vs tp=1 = {err:.3g}")
    for r in ranks:
        assert r["tokens"] == ref["tokens"]
        assert len(r["logits"]) == len(ref["logits"])
        for a, b in zip(r["logits"], ref["logits"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert all(torch.equal(a, b) for a, b in zip(r["logits"], ranks[0]["logits"]))
        for a, b in zip(r["ep_logits"], ref["logits"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _glm5_fp8_names(cfg: GlmConfig) -> frozenset[str]:
    """GLM-5-FP8's FP8 parameters, from the checkpoint names the model implies (no weights)."""
    with torch.device("meta"):
        names = list(checkpoint_tensors(GlmForCausalLM(cfg, dtype=torch.bfloat16)))
    return fp8_param_names(cfg, names + [n + SCALE for n in names if glm5_slice.fp8_in_glm5(n)])


def test_glm5_fp8_splits_in_whole_blocks_up_to_tp16():
    cfg = GlmConfig.from_dict({**GLM5, "quantization_config": glm5_slice.FP8_QUANTIZATION_CONFIG})
    fp8 = _glm5_fp8_names(cfg)
    assert "model.layers.3.mlp.experts.down_proj" in fp8 and "model.layers.0.self_attn.indexer.wk.weight" in fp8
    assert not any("embed_tokens" in n or "lm_head" in n or ".gate." in n or "weights_proj" in n for n in fp8)
    for tp in (1, 2, 4, 8, 16):
        check_tp(cfg, tp, fp8)
    # tp = 32: an expert's 2048-wide intermediate gives parts of 64, half a block.
    with pytest.raises(ConfigError, match=r"mlp\.(experts|shared_experts)\.\S+: tensor_parallel_size=32 .*parts of 64"):
        check_tp(cfg, 32, fp8)
    check_tp(cfg, 32)  # dequantized (bfloat16) it splits
    with pytest.raises(ConfigError, match=r"weight_block_size: FP8 weights are kept FP8 only with \[128, 128\]"):
        with torch.device("meta"):
            GlmForCausalLM(GlmConfig.from_dict({**cfg.raw, "quantization_config": {
                **glm5_slice.FP8_QUANTIZATION_CONFIG, "weight_block_size": [64, 64]}}), fp8=fp8)


def test_fp8_slice_has_the_glm5_fp8_layout(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "config.json").write_text(json.dumps({"vocab_size": 300, "eos_token_id": [297, 299], "pad_token_id": 297}))
    tiny = {"hidden_size": 192, "intermediate_size": 256, "moe_intermediate_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 2, "q_lora_rank": 160, "kv_lora_rank": 32, "qk_nope_head_dim": 48,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8}
    out = tmp_path / "slice"
    glm5_slice.main([str(out), "--layers", "4", "--experts", "3", "--vocab", "320", "--tokenizer-from", str(tok),
                     "--fp8", *[f"--width={k}={v}" for k, v in tiny.items()]])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    sd = {}
    for f in set(index.values()):
        sd.update(load_file(str(out / f)))
    assert set(sd) == set(index)
    scales = {n for n in sd if n.endswith(SCALE)}
    fp8 = {n for n in sd if sd[n].dtype == FP8}
    assert {n + SCALE for n in fp8} == scales
    # Exactly GLM-5-FP8's: the MLA projections, the indexer's wq_b and wk, every MLP and expert projection.
    kinds = {re.sub(r"experts\.\d+\.", "experts.E.", re.sub(r"^model\.layers\.\d+\.", "", n[: -len(".weight")]))
             for n in fp8}
    assert kinds == {
        "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
        "self_attn.o_proj", "self_attn.indexer.wq_b", "self_attn.indexer.wk", "mlp.gate_proj", "mlp.up_proj",
        "mlp.down_proj", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj",
        "mlp.experts.E.gate_proj", "mlp.experts.E.up_proj", "mlp.experts.E.down_proj",
    }
    assert any(".mlp.experts.2.down_proj.weight" in n for n in fp8)
    for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
              "model.layers.0.self_attn.indexer.weights_proj.weight", "model.layers.0.self_attn.indexer.k_norm.weight",
              "model.layers.1.self_attn.kv_a_layernorm.weight"):
        assert sd[n].dtype == torch.bfloat16, n
    assert sd["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 2)  # 48 rows, 192 cols
    # The loader keeps it FP8 and the forward runs.
    runner = ModelRunner.from_dir(out, page_size=PAGE, num_pages=PAGES, dtype=torch.bfloat16, progress=False, fp8=True)
    # 3 MoE layers x 3 experts x 3 projections are 9 stacks; the 4 kv_b_proj are dequantized.
    assert len(runner.model.fp8_params) == len(fp8) - 27 + 9 - 4
    res = scenario(runner, greedy)
    assert all(torch.isfinite(x).all() for x in res["logits"])
