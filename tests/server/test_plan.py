"""`glm53-serve plan` and `up`'s refusal of a layout that cannot fit (issue 29, item 3): weight
bytes counted from the instantiated shard (equal to what the loader really holds), the FP8 layout
read from config.json alone, GLM-5-FP8 at tp 8, the shipped H200 configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from glm53.models.config import GlmConfig
from glm53.models.fused import fuse_projections_, padding_bytes
from glm53.models.kv_cache import FP8, kv_bytes_per_token
from glm53.models.model import GlmForCausalLM
from glm53.models.parallel import TPGroup
from glm53.models.weights import checkpoint_files, fp8_param_names, glm5_fp8_param_names, load_model
from glm53.server.cli import main
from glm53.server.engine.worker import DTYPES, rank_specs, stage_layers
from glm53.server.plan import GB, Layout, plan_instance
from glm53.models.mtp_weights import build_nextn
from glm53.support.glm5_slice import FP8_QUANTIZATION_CONFIG, slice_config
from glm53.support.mtp_checkpoint import random_nextn, write_mtp_layer
from glm53.support.oracle import FP8_WIDTHS, make_checkpoint, quantise_fp8_
from tests.models.glm5_config import GLM5

ROOT = Path(__file__).resolve().parents[2]
H200_GB = "150.75"  # 143,771 MiB, as CUDA reports an H200


def _config_dir(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def glm5_fp8(tmp_path_factory) -> Path:
    """GLM-5-FP8's config.json alone: no weights, as `plan` needs."""
    cfg = dict(GLM5, architectures=["GlmMoeDsaForCausalLM"], torch_dtype="bfloat16",
               quantization_config=dict(FP8_QUANTIZATION_CONFIG))
    return _config_dir(tmp_path_factory.mktemp("glm5-fp8"), cfg)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("oracle-fp8")
    make_checkpoint(path, seed=int(torch.randint(0, 2**31, ()).item()), **FP8_WIDTHS)
    quantise_fp8_(path, block=128)
    return path


def _plan_cli(capsys, *args: str) -> tuple[int, dict, str]:
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, json.loads(out.strip().splitlines()[-1]), err


def test_glm5_fp8_fits_tp8_with_200k_fp8_kv_tokens(capsys, glm5_fp8):
    rc, summary, _ = _plan_cli(capsys, "--model", str(glm5_fp8), "--tp", "8", "--kv-cache-dtype", "fp8_e4m3",
                               "--gpu-memory-gb", H200_GB)
    assert rc == 0 and summary["fits"]
    assert summary["max_kv_tokens"] >= 200_000
    # 656 B latent + 132 B index keys on each of 78 layers (../shared/reference/dsa.md §4)
    assert summary["kv_bytes_per_token"] == 78 * (656 + 132)
    # ~0.75 TB over 8 GPUs plus the replicated latent projections, indexers and routers
    assert 90 * GB < summary["weight_bytes_per_gpu"] < 100 * GB


def test_glm5_fp8_expert_parallel_holds_whole_experts(glm5_fp8):
    # ep = 8 at tp = 8: 32 whole experts per rank instead of 1/8 of all 256: the same bytes
    tp8 = plan_instance(glm5_fp8, Layout(tp=8, kv_cache_dtype="fp8_e4m3"))
    ep8 = plan_instance(glm5_fp8, Layout(tp=8, ep=8, kv_cache_dtype="fp8_e4m3"))
    assert ep8.fits and ep8.weight_bytes_per_gpu == tp8.weight_bytes_per_gpu
    with pytest.raises(Exception, match="expert_parallel_size"):
        plan_instance(glm5_fp8, Layout(tp=8, ep=3))


def test_dequantized_glm5_does_not_fit_and_names_the_numbers(capsys, glm5_fp8):
    rc, summary, err = _plan_cli(capsys, "--model", str(glm5_fp8), "--tp", "8", "--dtype", "bfloat16",
                                 "--gpu-memory-gb", H200_GB)
    assert rc == 1 and not summary["fits"] and summary["max_kv_tokens"] == 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "GiB" in lines[0] and "weights" in lines[0] and "0.85" in lines[0], err
    assert summary["weight_bytes_per_gpu"] > 2 * 0.75e12 / 8 * 0.95  # twice the FP8 bytes, dequantized


def test_a_reserve_too_small_for_a_step_is_refused(capsys, glm5_fp8):
    rc, summary, err = _plan_cli(capsys, "--model", str(glm5_fp8), "--tp", "8", "--gpu-memory-gb", H200_GB,
                                 "--mem-fraction-static", "0.97", "--chunked-prefill-size", "16384")
    assert rc == 1 and not summary["fits"]
    assert "reserve outside mem_fraction_static" in err


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 1), (1, 2, 1), (2, 1, 2)])
def test_weight_and_kv_bytes_are_what_a_loaded_rank_holds(fp8_checkpoint, tp, pp, ep):
    """The plan's per-stage figures equal the rank-0 shard the streaming loader really builds, fused
    as the runner serves it (block-FP8 members padded to whole 128-row blocks)."""
    cfg = GlmConfig.from_dir(fp8_checkpoint)
    dtype = DTYPES[cfg.torch_dtype]  # what dtype "auto" runs
    plan = plan_instance(fp8_checkpoint, Layout(tp=tp, pp=pp, ep=ep, dtype="auto", gpu_bytes=10 * GB))
    assert plan.fp8_weights > 0
    for stage, layers in zip(plan.stages, stage_layers(cfg.num_hidden_layers, pp)):
        model = load_model(fp8_checkpoint, dtype=dtype, layers=layers, tp=TPGroup.for_shapes(tp), ep=ep,
                           progress=False)
        fuse_projections_(model)
        held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        assert stage.weight_bytes == held + padding_bytes(model)
        assert padding_bytes(model) > 0  # kv_a's rows are not whole blocks in this checkpoint
        assert any(p.dtype == FP8 for p in model.parameters())
        assert stage.kv_bytes_per_token == kv_bytes_per_token(cfg, dtype, layers)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_nextn_adds_what_the_last_stage_loads(tmp_path, tp, pp):
    """With NEXTN the last stage also holds the MTP layer as the ranks load it (its own embedding
    under PP) and its two pools."""
    d = tmp_path / "target"
    make_checkpoint(d, seed=int(torch.randint(0, 2**31, ()).item()))
    dtype = DTYPES[GlmConfig.from_dir(d).torch_dtype]
    write_mtp_layer(d, random_nextn(GlmConfig.from_dir(d), seed=5, dtype=dtype))
    cfg = GlmConfig.from_dir(d)  # num_nextn_predict_layers: 1 now
    plain = plan_instance(d, Layout(tp=tp, pp=pp, gpu_bytes=10 * GB))
    nextn = plan_instance(d, Layout(tp=tp, pp=pp, gpu_bytes=10 * GB, nextn=True))
    draft = build_nextn(d, cfg, dtype=dtype, device="meta", tp=TPGroup.for_shapes(tp), embed=pp > 1)
    held = sum(t.numel() * t.element_size() for t in [*draft.parameters(), *draft.buffers()])
    assert nextn.stages[-1].weight_bytes - plain.stages[-1].weight_bytes == held > 0
    assert nextn.stages[-1].kv_bytes_per_token - plain.stages[-1].kv_bytes_per_token == \
        (cfg.latent_dim + cfg.index_head_dim) * dtype.itemsize
    assert [s.weight_bytes for s in nextn.stages[:-1]] == [s.weight_bytes for s in plain.stages[:-1]]


def test_glm5_fp8_with_its_mtp_layer_still_fits_tp8(capsys, glm5_fp8):
    """GLM-5's layer 78 (FP8 like the last layer, its own embedding and head, eh_proj in bf16)
    costs about a layer's share of the weights plus those, and tp 8 keeps >= 200K FP8 KV tokens."""
    plain = plan_instance(glm5_fp8, Layout(tp=8, kv_cache_dtype="fp8_e4m3"))
    nextn = plan_instance(glm5_fp8, Layout(tp=8, kv_cache_dtype="fp8_e4m3", nextn=True))
    extra = nextn.weight_bytes_per_gpu - plain.weight_bytes_per_gpu
    layer = plain.weight_bytes_per_gpu / GLM5["num_hidden_layers"]
    h, v = GLM5["hidden_size"], GLM5["vocab_size"]
    own = 2 * v * h * 2 / 8 + 2 * h * h * 2  # embedding and head (split over tp 8), eh_proj (replicated)
    assert 0.8 * layer + own < extra < 1.2 * layer + own
    assert nextn.fits and nextn.max_kv_tokens >= 200_000
    rc, summary, _ = _plan_cli(capsys, "--model", str(glm5_fp8), "--tp", "8", "--kv-cache-dtype", "fp8_e4m3",
                               "--speculative-algorithm", "NEXTN")
    assert rc == 0 and summary["weight_bytes_per_gpu"] == nextn.weight_bytes_per_gpu


def test_fp8_layout_from_config_alone_matches_the_checkpoint(fp8_checkpoint, tmp_path):
    cfg = GlmConfig.from_dir(fp8_checkpoint)
    with torch.device("meta"):
        model = GlmForCausalLM(cfg, dtype=torch.bfloat16)
    assert glm5_fp8_param_names(cfg, model) == fp8_param_names(cfg, checkpoint_files(fp8_checkpoint))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(fp8_checkpoint / "config.json", bare / "config.json")
    with_ckpt = plan_instance(fp8_checkpoint, Layout(tp=2, gpu_bytes=10 * GB))
    without = plan_instance(bare, Layout(tp=2, gpu_bytes=10 * GB))
    assert with_ckpt.summary() == without.summary()


def _model_dir_for(config: Path, root: Path) -> Path:
    """A config.json for the model a shipped config names (the GLM-5-FP8 release or the slice)."""
    path = yaml.safe_load(config.read_text())["model"]["path"]
    name = Path(path).name
    if name == "GLM-5-FP8":
        cfg = dict(GLM5, architectures=["GlmMoeDsaForCausalLM"], torch_dtype="bfloat16",
                   quantization_config=dict(FP8_QUANTIZATION_CONFIG))
    else:
        assert "slice" in name, f"{config}: plan this model in the test ({path})"
        cfg = slice_config(4, 16, GLM5["vocab_size"], fp8="fp8" in name)
    return _config_dir(root / name, cfg)


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("h200-*.yaml")), ids=lambda p: p.name)
def test_shipped_gpu_configs_pass_plan(capsys, tmp_path, config):
    model = _model_dir_for(config, tmp_path)
    rc, summary, err = _plan_cli(capsys, "--config", str(config), "--model", str(model), "--gpu-memory-gb", H200_GB)
    assert rc == 0 and summary["fits"], err
    if "glm5-fp8" in config.name:
        assert summary["max_kv_tokens"] >= 200_000
    for key, inst in summary["instances"].items():
        assert inst["fits"], key


def test_colocated_instances_share_weights_and_the_reserve(capsys, tmp_path):
    config = ROOT / "configs" / "h200-one-gpu.yaml"
    model = _model_dir_for(config, tmp_path)
    rc, summary, _ = _plan_cli(capsys, "--config", str(config), "--model", str(model), "--gpu-memory-gb", H200_GB)
    assert rc == 0
    assert summary["instances"]["prefill[0]"]["weight_bytes_per_gpu"] == 0  # the decode rank's copy
    assert summary["instances"]["decode[0]"]["weight_bytes_per_gpu"] > 0


def test_up_refuses_a_layout_that_cannot_fit_before_starting_anything(capsys, tmp_path, glm5_fp8):
    cfg = tmp_path / "too-small.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"path": str(glm5_fp8)}, "router": {"port": 0},
        "defaults": {"device": "cuda"},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "devices": [0]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "devices": [1]}]}))
    assert main(["up", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "prefill[0]" in err and "does not fit its GPUs" in err and "GiB" in err
    assert "ready" not in err


def test_a_tp_that_cuts_fp8_blocks_is_a_config_error_on_any_device(capsys, tmp_path, fp8_checkpoint):
    # FP8_WIDTHS' routed experts are 256 wide: tp 4 leaves parts of 64, not whole 128-blocks. The
    # CPU instances are not planned, but the model-fit check reads the FP8 names from the index.
    def config(dtype: str) -> str:
        path = tmp_path / f"{dtype}.yaml"
        path.write_text(yaml.safe_dump({
            "model": {"path": str(fp8_checkpoint), "skip_tokenizer_init": True}, "router": {"port": 0},
            "defaults": {"device": "cpu", "dtype": dtype},
            "prefill": [{"name": "p0", "host": "127.0.0.1", "tp": 4}],
            "decode": [{"name": "d0", "host": "127.0.0.1"}]}))
        return str(path)

    assert main(["config", "--config", config("auto")]) == 2
    err = capsys.readouterr().err
    assert "prefill[0].tp" in err and "128" in err and "bfloat16" in err, err
    assert main(["config", "--config", config("bfloat16")]) == 0  # dequantized: any split of the width


def test_a_prefill_instance_with_prefill_graphs_reserves_their_pool(glm5_fp8):
    """A prefill instance on one GPU captures graphs of chunks up to PREFILL_GRAPH_TOKENS
    (engine/worker.py): their pool holds such a chunk's activations on top of the eager chunk's,
    so its plan needs that much more reserve; decode, tp > 1 and disable_cuda_graph add nothing."""
    from glm53.models.prefill_graph import PREFILL_GRAPH_TOKENS
    from glm53.server.config_parse import parse_config
    from glm53.server.plan import chunk_bytes, instance_layout

    def cluster(**prefill):
        return parse_config({
            "model": {"path": str(glm5_fp8)}, "router": {"port": 0}, "defaults": {"device": "cuda"},
            "prefill": [{"name": "p0", "host": "127.0.0.1", "devices": list(range(prefill.get("tp", 1))), **prefill}],
            "decode": [{"name": "d0", "host": "127.0.0.1", "devices": [7]}]})

    c = cluster()
    pre, dec = instance_layout(c, c.prefill[0], 8 * GB), instance_layout(c, c.decode[0], 8 * GB)
    assert pre.prefill_graph_tokens == PREFILL_GRAPH_TOKENS and dec.prefill_graph_tokens == 0
    # the rank that captures them reads the same rule
    assert [s.prefill_graph_tokens for s in rank_specs(c, c.prefill[0], str(glm5_fp8), 4)] == [PREFILL_GRAPH_TOKENS]
    for off in (cluster(tp=2), cluster(disable_cuda_graph=True)):
        assert instance_layout(off, off.prefill[0], 8 * GB).prefill_graph_tokens == 0
    small = cluster(chunked_prefill_size=128)  # a graph never holds more than a chunk
    assert instance_layout(small, small.prefill[0], 8 * GB).prefill_graph_tokens == 128
    with_graphs = plan_instance(glm5_fp8, Layout(tp=8, prefill_graph_tokens=PREFILL_GRAPH_TOKENS))
    without = plan_instance(glm5_fp8, Layout(tp=8))
    context = GLM5["max_position_embeddings"]
    pool = chunk_bytes(GlmConfig.from_dict(GLM5), Layout(tp=8), PREFILL_GRAPH_TOKENS, context, 8)
    assert with_graphs.activation_bytes - without.activation_bytes == pool > 256 * context * 4
