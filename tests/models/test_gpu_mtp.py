"""The MTP (NextN) draft on a GPU (eager: CUDA graphs of its chained step are not built): its
rows on CUDA (Triton MLA, indexer and MoE kernels over the mtp pools) against the CPU, and greedy
decoding with the draft equal to plain decoding on the same device, fp32 and bf16. Skipped
without a GPU."""

from __future__ import annotations

import pytest
import torch

from glm53.models import GlmConfig, ModelRunner, SeqChunk
from glm53.support.greedy import spec_greedy
from glm53.support.mtp_checkpoint import random_nextn, write_mtp_layer
from glm53.support.oracle import make_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels)"),
]

PS, PAGES = 16, 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_mtp") / "target"
    make_checkpoint(d, seed=21, index_topk_freq=2, index_skip_topk_offset=2)
    write_mtp_layer(d, random_nextn(GlmConfig.from_dir(d), seed=22))
    return d


def _runner(d, device, dtype=torch.float32, steps=3):
    return ModelRunner.from_dir(d, page_size=PS, num_pages=PAGES, device=device, dtype=dtype, progress=False,
                                nextn_steps=steps)


def test_rows_match_cpu(ckpt):
    g = torch.Generator().manual_seed(3)
    cfg = GlmConfig.from_dir(ckpt)
    toks = torch.randint(0, cfg.vocab_size, (40,), generator=g).tolist()  # 40 > index_topk: sparse
    hidden = torch.randn(40, cfg.hidden_size, generator=g)
    out = {}
    for dev in ("cpu", "cuda"):
        r = _runner(ckpt, dev)
        batch, _ = r.build_batch([SeqChunk(toks, 0, [5, 9, 2])])
        out[dev] = r.mtp.rows(batch.input_ids, hidden.to(dev), batch).cpu()
    torch.testing.assert_close(out["cuda"], out["cpu"], rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_plain_on_cuda(ckpt, dtype):
    prompts, n = [[7, 3, 99, 41, 8] * 9, [120, 5, 66]], 20
    plain = ModelRunner.from_dir(ckpt, page_size=PS, num_pages=PAGES, device="cuda", dtype=dtype, progress=False)
    r = _runner(ckpt, "cuda", dtype)
    pages = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    want = []
    for p, pg in zip(prompts, pages):
        out = [int(plain.forward([SeqChunk(p, 0, pg)])[0][-1].argmax())]
        while len(out) < n:
            out.append(int(plain.forward([SeqChunk([out[-1]], len(p) + len(out) - 1, pg)])[0][-1].argmax()))
        want.append(out)
    outs, _, _ = spec_greedy(r, prompts, pages, n, width=4)
    assert outs == want
