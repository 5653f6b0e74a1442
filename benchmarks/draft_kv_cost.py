"""What `speculative.draft_kv_transfer: false` costs in τ, through the whole PD pipeline (router,
prefill, UCX transfer, decode) on the embedded trained pair, greedy, block 16.

    PYTHONPATH=. python benchmarks/draft_kv_cost.py

Prompts: the first 1,500 characters of every 25th module of this Python's standard library (up to
8). τ = tokens committed after the first (which prefill samples) per verify step.
"""

from __future__ import annotations

import sysconfig
import tempfile
from pathlib import Path

import httpx

from glm53.support.cluster import Cluster


def main() -> None:
    src = Path(sysconfig.get_paths()["stdlib"])
    texts = [f.read_text(errors="ignore")[:1500] for f in sorted(src.glob("*.py"))[::25][:8]]
    cache = Path(tempfile.mkdtemp(prefix="kvcost-"))
    for kv in (True, False):
        spec = {"algorithm": "DFLASH", "draft_model_path": "embedded:tiny-glm5-dflash", "num_draft_tokens": 16,
                "draft_kv_transfer": kv}
        c = Cluster(Path(tempfile.mkdtemp()), cache, speculative=spec).start()
        try:
            toks = verify = 0
            for t in texts:
                r = httpx.post(f"{c.url}/generate", timeout=300, json={"text": t, "sampling_params": {
                    "max_new_tokens": 64, "temperature": 0, "ignore_eos": True}}).json()
                toks += r["meta_info"]["completion_tokens"] - 1
                verify += r["meta_info"]["spec_verify_ct"]
            print(f"draft_kv_transfer={kv}: {len(texts)} prompts, {toks} tokens after the first, "
                  f"{verify} verify steps, tau {toks / verify:.2f}", flush=True)
        finally:
            c.stop()


if __name__ == "__main__":
    main()
