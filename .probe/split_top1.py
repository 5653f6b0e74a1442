"""CPU emulation: greedy top-1 agreement at decode steps when the w8a8 products' activations are
rounded to e4m3 in one term (as served) or two (hi + the residual's own e4m3 codes)."""
import sys, torch
from pathlib import Path
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import gpu_e2e
from glm53.kernels import fp8_gemm, moe as kmoe
from glm53.kernels.fp8_quant import quantize_fp8_groups_reference as qg, dequantize_fp8_groups as dq
from glm53.models import ModelRunner, SeqChunk
torch.manual_seed(0)
MODE = {"terms": 0, "decode": False}
def rnd(x):
    t = MODE["terms"] if MODE["decode"] else MODE.get("pre_terms", 0)
    if t == 0: return x
    sh = x.shape; x2 = x.reshape(-1, sh[-1]).float()
    q, s = qg(x2); y = dq(q, s)
    if t == 2:
        r = x2 - y; q2, s2 = qg(r); y = y + dq(q2, s2)
    return y.reshape(sh).to(x.dtype)
ref_gemm = fp8_gemm.fp8_gemm_reference
fp8_gemm.fp8_gemm_reference = lambda x, w, s, o=None: ref_gemm(rnd(x), w, s, o)
import torch.nn.functional as F
def swiglu(x, g, u, d):
    x = rnd(x); h = F.silu(x @ g.t()) * (x @ u.t()); return rnd(h) @ d.t()
kmoe.swiglu_mlp = swiglu
model_dir = gpu_e2e.quantized_tiny(Path("/tmp/tiny-fp8"))
from tokenizers import Tokenizer
import transformers
tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
prompts = []
for f in sorted(Path(transformers.__file__).parent.rglob("*.py")):
    ids = tok.encode(f.read_text(errors="replace")).ids
    if len(ids) >= 192: prompts.append(ids[:192])
    if len(prompts) == 16: break
steps = 64; n = len(prompts); L = 192
pp = -(-(L + steps + 1) // 64); pages = [list(range(i * pp, (i + 1) * pp)) for i in range(n)]
def run(dtype, follow):
    r = ModelRunner.from_dir(model_dir, page_size=64, num_pages=pp * n, device="cpu", dtype=dtype, fp8=True, progress=False)
    MODE["decode"] = False
    out = r.forward([SeqChunk(p, 0, pg, all_logits=True) for p, pg in zip(prompts, pages)])
    rows = [torch.cat(out).float()]; toks = [o[-1].argmax(-1).item() for o in out]; fed = []
    MODE["decode"] = True
    for t in range(steps):
        feed = [f[t] for f in follow] if follow is not None else toks
        fed.append(feed)
        lg = r.forward([SeqChunk([feed[i]], L + t, pages[i]) for i in range(n)])
        rows.append(torch.cat(lg).float()); toks = rows[-1].argmax(-1).tolist()
    return torch.cat(rows), [[fed[t][i] for t in range(steps)] for i in range(n)]
MODE["terms"] = 0
ref, follow = run(torch.float32, None)
npre = n * L
for dtype in (torch.float32, torch.bfloat16):
    for terms in (0, 1, 2):
        MODE["terms"] = terms
        rows, _ = run(dtype, follow)
        same = rows.argmax(-1) == ref.argmax(-1)
        print(f"{dtype} decode terms={terms}: prompt {same[:npre].float().mean():.4f} decode {same[npre:].float().mean():.4f}", flush=True)
