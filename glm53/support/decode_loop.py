"""The decode scheduler's real loop on one in-process rank (no prefill instance is started): a
`DecodeScheduler` built from a raw config (`scheduler`), and greedy requests adopted as if
prefill had sent their first token, decoded to the end (`decode_run`), timed. Used by
benchmarks/dflash.py, tools/eval_dflash.py and tests/models/test_gpu_spec_graphs.py.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from glm53.kernels.compile_watch import WATCH
from glm53.models import SeqChunk
from glm53.models.prefill_graph import PREFILL_GRAPH_TOKENS, PrefillGraphs
from glm53.server.config_parse import parse_config
from glm53.server.engine.decode import DecodeScheduler
from glm53.server.engine.decode_request import DecodeRequest
from glm53.server.protocol import GenerateRequest, PeerInfo, RequestSpec
from glm53.server.sampling import SamplingParams
from glm53.support.ports import free_ports


def scheduler(model_dir: Path, draft: Path | None, device: str, block: int | None, graphs: bool = True,
              max_running: int = 64, dtype: str = "float32", context: int | None = None,
              threshold: float = 0.0, overlap: bool = True, prefill_graphs: bool = True,
              page_size: int = 16) -> DecodeScheduler:
    """A decode scheduler on one in-process rank (no prefill instance is started). On CUDA it
    captures its decode graphs (with a draft: of the DFlash step) for batches up to
    `max_running` and requests up to `context` tokens (None: the model's) unless `graphs` is False.
    The algorithm follows the draft: DSPARK for one with a Markov head (cutting its blocks at
    confidence `threshold`), else DFLASH. `overlap` False runs every step synchronously
    (`disable_overlap_schedule`). The prompts' forwards (`decode_run`) stand in for a prefill
    instance's: with graphs on CUDA (and `prefill_graphs`), a prompt chunk of up to
    PREFILL_GRAPH_TOKENS replays a prefill graph, as a prefill rank's does. The pools hold 2,048
    pages of `page_size` tokens."""
    ports = free_ports(4)
    raw = {
        "model": {"path": str(model_dir), **({"context_length": context} if context else {})},
        "defaults": {"device": device, "dtype": dtype, "page_size": page_size, "num_pages": 2048,
                     "stream_interval": 1000, "max_running_requests": max_running,
                     "disable_cuda_graph": not graphs, "disable_overlap_schedule": not overlap},
        "prefill": [{"name": "p0", "host": "127.0.0.1", "port": ports[0], "bootstrap_port": ports[1]}],
        "decode": [{"name": "d0", "host": "127.0.0.1", "port": ports[2], **({"devices": [0]} if device == "cuda" else {})}],
    }
    if device == "cuda":
        raw["prefill"][0]["devices"] = [1]  # never started here; the config wants distinct GPUs
    if draft is not None:
        from glm53.models import GlmConfig, draft_config

        algo = draft_config(draft, GlmConfig.from_dir(model_dir)).algorithm
        raw["speculative"] = {"algorithm": algo, "draft_model_path": str(draft), "num_draft_tokens": block,
                              **({"dspark_confidence_threshold": threshold} if threshold and algo == "DSPARK" else {})}
    cfg = parse_config(raw)
    sched = DecodeScheduler(cfg, cfg.decode[0])
    runner = sched.workers.rank.runner
    if device == "cuda" and graphs and prefill_graphs and runner.mtp is None:
        longest = min(context or runner.cfg.max_position_embeddings, sched.workers.num_pages * sched.workers.page_size)
        # The pools' padding page (page num_pages, which no allocator hands out) is the graphs'.
        runner.prefill_graphs = PrefillGraphs(runner, PREFILL_GRAPH_TOKENS, longest, pad_page=sched.workers.num_pages)
    return sched


def decode_run(sched: DecodeScheduler, prompts: list[list[int]], new: int,
               clock=time.perf_counter, params: SamplingParams | None = None,
               prefill: bool = False, running: int | None = None,
               stats: dict | None = None) -> tuple[float, int, int, list]:
    """(seconds of decode steps, tokens committed after the first, verify steps, outputs).
    `clock=time.thread_time` counts only this thread's CPU time (on a CPU shared with other
    jobs, wall time also counts the time the scheduler gave to them). `params`: the requests'
    sampling (default greedy; max_new_tokens and ignore_eos are set here; a seed is per prompt
    seed + room). `prefill`: the timed span starts before the prompts' prefill forwards (which,
    with a draft, also write its context KV): end to end, not decode only. `running`: at most this
    many requests decode at once, the next prompt joining as one finishes (a server's steady
    batch; None: all at once, so the batch thins out as requests end: with speculation they end
    at different steps). `stats`: filled with the decode steps, the requests summed over steps
    (`rows`), the loop's wall seconds (`wall_s`, decode only) and, with a draft, the seconds inside
    `WorkerGroup.spec_step` (`spec_s`; the rest of `wall_s` is the scheduler's host work)."""
    sent = []
    sched.channel.send = lambda _to, ev: sent.append(ev)
    queue = []  # (request, first token): prefilled, not yet decoding
    t_pre = clock()
    for room, p in enumerate(prompts):
        base = params or SamplingParams(temperature=0.0)
        seed = None if base.seed is None else base.seed + room
        params_r = dataclasses.replace(base, max_new_tokens=new, ignore_eos=True, seed=seed)
        req = GenerateRequest(spec=RequestSpec(f"r{room}", p, params_r, []), room=room, generation=0,
                              prefill=PeerInfo("p0", "prefill", "h", 1, 2), decode=PeerInfo("d0", "decode", "h", 3, None),
                              reply_to="tcp://unused:1")
        r = DecodeRequest(req, arrived=0.0, pages=sched.allocator.alloc(sched.workers.pages_needed(len(p) + new)))
        # Stands in for the prefill instance, whose own warm-up compiles prompt-sized variants (a
        # decode rank's covers its batch × verify tokens and never prefills): not a decode compile.
        with WATCH.warming():
            first = sched.workers.forward([SeqChunk(p, 0, r.pages)])[0][-1].argmax()
        queue.append((r, int(first)))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    queue.reverse()  # popped from the end: prompt order
    limit = running or len(prompts)

    def adopt():  # the first token streamed, the request decoding
        while queue and len(sched.running) < limit:
            r, first = queue.pop()
            sched._commit(r, [first], first=True)

    adopt()
    spec_s = [0.0]
    workers = sched.workers
    inner, patched = workers.spec_step, "spec_step" in vars(workers)

    def timed_spec_step(blocks):
        t = time.perf_counter()
        try:
            return inner(blocks)
        finally:
            spec_s[0] += time.perf_counter() - t

    workers.spec_step = timed_spec_step
    steps = rows = 0
    t0 = t_pre if prefill else clock()
    t_wall = time.perf_counter()
    try:
        while sched.running or queue or sched.inflight is not None:  # an overlapped step in flight
            adopt()
            rows += len(sched.running)
            steps += 1
            sched._decode()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = clock() - t0
        wall = time.perf_counter() - t_wall
    finally:
        if patched:
            workers.spec_step = inner
        else:
            del workers.spec_step
    if stats is not None:
        stats.update(steps=steps, rows=rows, spec_s=spec_s[0], wall_s=wall)
    outs: dict[int, list[int]] = {}
    verify = 0
    for ev in sent:
        outs.setdefault(ev.room, []).extend(ev.token_ids)
        verify += len(ev.spec_accept)
    return dt, len(prompts) * (new - 1), verify, [outs[i] for i in range(len(prompts))]
