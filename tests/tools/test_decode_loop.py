"""glm53/support/decode_loop.decode_run, the loop tools/eval_dflash.py times: a steady batch
(`running`: prompts join as others finish) decodes every prompt to the same greedy output as all
at once, with and without the trained DFlash draft, and its step statistics add up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glm53.support.decode_loop import decode_run, scheduler

ROOT = Path(__file__).resolve().parents[2]
MODEL, DRAFT = ROOT / "assets/tiny-glm5", ROOT / "assets/tiny-glm5-dflash"


@pytest.mark.skipif(not (MODEL / "model.safetensors").exists() or not (DRAFT / "model.safetensors").exists(),
                    reason="the trained tiny pair is not in this checkout")
def test_steady_batch_decodes_what_all_at_once_does():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 4000, (int(n),), generator=g).tolist() for n in (40, 23, 57, 31, 18)]
    new = 12
    outs = {}
    for draft in (None, DRAFT):
        sched = scheduler(MODEL, draft, "cpu", 4 if draft else None, graphs=False, max_running=8)
        try:
            for running in (None, 2):
                st: dict = {}
                _, toks, verify, out = decode_run(sched, prompts, new, running=running, stats=st)
                assert toks == len(prompts) * (new - 1) and [len(o) for o in out] == [new] * len(prompts)
                outs[(draft, running)] = out
                # Every request is in every step from its adoption to its end: at most `running`.
                assert st["steps"] > 0 and st["rows"] <= st["steps"] * (running or len(prompts))
                if draft is None:
                    assert st["spec_s"] == 0.0 and st["rows"] >= len(prompts) * (new - 1)
                else:
                    assert st["rows"] == verify and 0.0 < st["spec_s"] <= st["wall_s"]
            assert "spec_step" not in vars(sched.workers)  # the timer is taken off again
        finally:
            sched.close()
    assert len({str(o) for o in outs.values()}) == 1


@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="the trained tiny model is not in this checkout")
def test_stand_in_prefill_counts_as_warm_up():
    """decode_run's prompt forwards stand in for the prefill instance: a Triton compile there is
    not one of the decode loop's (compile_watch), while the decode steps' still are."""
    from glm53.kernels.compile_watch import WATCH

    torch.set_num_threads(1)
    sched = scheduler(MODEL, None, "cpu", None, graphs=False, max_running=4)
    seen = []  # (prompt forward or decode step, inside warming)
    warming = lambda: getattr(WATCH._local, "depth", 0) > 0  # noqa: E731
    fwd, step = sched.workers.forward, sched._decode

    def forward(chunks, *a, **kw):
        seen.append(("prefill", warming()))
        return fwd(chunks, *a, **kw)

    def decode(*a, **kw):
        seen.append(("decode", warming()))
        return step(*a, **kw)

    sched.workers.forward, sched._decode = forward, decode
    try:
        decode_run(sched, [[5, 9, 200, 31, 7], [44, 3, 12]], 3)
    finally:
        sched.close()
    assert [w for k, w in seen if k == "prefill"] == [True, True], seen
    assert "decode" in dict(seen) and not any(w for k, w in seen if k == "decode"), seen
