import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm53.models import GlmConfig, GlmForCausalLM, ModelRunner, PageAllocator, SeqChunk, WeightError
from glm53.models.weights import checkpoint_tensors, load_weights
from glm53.support.oracle import make_checkpoint, quantise_fp8_


def _forward(runner, ids):
    allocator = PageAllocator(runner.pools.num_pages)
    pages = allocator.alloc(runner.pages_needed(len(ids)))
    out = runner.forward([SeqChunk(ids, 0, pages, all_logits=True)])[0]
    allocator.free(pages)
    return out


def _rewrite(path, fn):
    sd = load_file(str(path / "model.safetensors"))
    fn(sd)
    save_file(sd, str(path / "model.safetensors"))


def test_sharded_checkpoint_and_mtp_layer_skipped(tmp_path, caplog):
    ref = make_checkpoint(tmp_path, seed=5, sharded=True)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    # Add an MTP layer (id == num_hidden_layers) to one shard and the index, as GLM-5 ships it.
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    sd = load_file(str(tmp_path / shard))
    sd["model.layers.5.eh_proj.weight"] = torch.randn(64, 128)
    sd["model.layers.5.self_attn.indexer.wk.weight"] = torch.randn(32, 64)
    save_file(sd, str(tmp_path / shard), metadata={"format": "pt"})
    index["weight_map"]["model.layers.5.eh_proj.weight"] = shard
    index["weight_map"]["model.layers.5.self_attn.indexer.wk.weight"] = shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level(logging.INFO):
        runner = ModelRunner.from_dir(tmp_path, page_size=8, num_pages=16, progress=False)
    assert sum("skipping MTP layer" in r.message for r in caplog.records) == 1
    ids = torch.randint(0, 160, (30,)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert float((_forward(runner, ids) - want).norm() / want.norm()) <= 1e-4


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    make_checkpoint(tmp_path, seed=6)
    _rewrite(tmp_path, lambda sd: sd.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(WeightError, match=r"missing.*model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"):
        ModelRunner.from_dir(tmp_path, progress=False)
    make_checkpoint(tmp_path, seed=6)
    _rewrite(tmp_path, lambda sd: sd.__setitem__("model.layers.1.self_attn.bogus.weight", torch.zeros(2)))
    with pytest.raises(WeightError, match=r"unexpected.*model\.layers\.1\.self_attn\.bogus\.weight"):
        ModelRunner.from_dir(tmp_path, progress=False)


def test_indexer_weights_disagreeing_with_schedule_are_refused(tmp_path):
    # Checkpoint written with every layer full; config then claims freq 2 (layers 2 and 4 shared).
    make_checkpoint(tmp_path, seed=7, index_topk_freq=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["indexer_types"] = ["full", "full", "shared", "full", "shared"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=r"layers \[2, 4\] are 'shared'.*carry indexer weights"):
        ModelRunner.from_dir(tmp_path, progress=False)
    # And the other direction: a full layer without indexer weights.
    make_checkpoint(tmp_path, seed=7, index_topk_freq=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["indexer_types"] = ["full"] * 5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match=r"layers \[2, 4\] are 'full'.*no indexer weights"):
        ModelRunner.from_dir(tmp_path, progress=False)


def test_block_fp8_checkpoint_is_dequantised(tmp_path):
    ref = make_checkpoint(tmp_path, seed=8)
    quantise_fp8_(tmp_path, block=16)
    runner = ModelRunner.from_dir(tmp_path, page_size=8, num_pages=16, progress=False)
    w = runner.model.model.layers["1"].self_attn.q_b_proj.weight
    w_ref = ref.model.layers[1].self_attn.q_b_proj.weight.detach()
    # e4m3 keeps 3 mantissa bits: dequantised weights are within ~6% per element.
    assert float((w - w_ref).norm() / w_ref.norm()) < 0.05
    assert float((w - w_ref).norm() / w_ref.norm()) > 0  # really quantised


def test_generate_cli_prints_one_json_line_per_prompt(tmp_path):
    make_checkpoint(tmp_path, seed=9)
    cmd = [sys.executable, "-m", "glm53.server.offline", "--model", str(tmp_path), "--input-ids", "1,2,3",
           "--input-ids", "4,5,6,7,8,9,10,11,12,13", "--max-new-tokens", "6", "--page-size", "4", "--ignore-eos"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["index"] for x in lines] == [0, 1]
    assert all(len(x["output_ids"]) == 6 for x in lines)
    assert lines[1]["input_ids"] == list(range(4, 14))


def _meta_model(cfg, layers=None):
    with torch.device("meta"):
        return GlmForCausalLM(cfg, layers=layers)


def test_checkpoint_tensors_is_the_hf_layout_and_the_loaders_inverse(tmp_path):
    make_checkpoint(tmp_path, seed=10, index_topk_freq=2, index_skip_topk_offset=2)
    cfg = GlmConfig.from_dir(tmp_path)
    hf = load_file(str(tmp_path / "model.safetensors"))
    want = checkpoint_tensors(_meta_model(cfg))
    assert {n: s for n, (s, _) in want.items()} == {n: tuple(t.shape) for n, t in hf.items()}
    assert list(want)[0] == "model.embed_tokens.weight"
    assert list(want)[-2:] == ["model.norm.weight", "lm_head.weight"]
    e = [n for n in want if n.startswith("model.layers.1.mlp.experts.")]
    assert e[:4] == [f"model.layers.1.mlp.experts.{i}.{p}.weight" for i, p in
                     ((0, "gate_proj"), (0, "up_proj"), (0, "down_proj"), (1, "gate_proj"))]

    # A checkpoint written from the derived list alone loads with no missing/unexpected tensor,
    # and every per-expert tensor lands in its slot of the stacked parameter.
    g = torch.Generator().manual_seed(1)
    sd = {n: torch.randn(s, generator=g).to(d) for n, (s, d) in want.items()}
    out = tmp_path / "derived"
    out.mkdir()
    (out / "config.json").write_text((tmp_path / "config.json").read_text())
    save_file(sd, str(out / "model.safetensors"))
    model = GlmForCausalLM(cfg)
    load_weights(model, out, progress=False)
    up = model.model.layers["3"].mlp.experts.up_proj
    assert torch.equal(up[5], sd["model.layers.3.mlp.experts.5.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, sd["lm_head.weight"])

    # A middle stage lists its own layers only, and loads from the whole checkpoint.
    stage = checkpoint_tensors(_meta_model(cfg, range(2, 4)))
    assert {n.split(".")[2] for n in stage} == {"2", "3"}
    assert not any(n.startswith(("model.embed_tokens", "model.norm", "lm_head")) for n in stage)
    load_weights(GlmForCausalLM(cfg, layers=range(2, 4)), out, progress=False)
