"""Helpers for the tensor-parallel tests: running a function in `world` real processes joined by
gloo, the serving scenario every rank (and the single-rank reference) runs, and recorders of
top-k selections and of what the loader reads from safetensors files."""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import glm53.models.model as model_mod
import glm53.models.moe as moe_mod
import glm53.models.weights as weights_mod
from glm53.models import ModelRunner, PageAllocator, SeqChunk, TPGroup
from glm53.models.sharding import Shard, shard_of
from glm53.models.weights import checkpoint_tensors, param_of
from glm53.support.ports import free_ports

TOPK = 8  # the oracle's index_topk
PAGE, PAGES = 4, 96
CHUNK = 16
DECODE_STEPS = 5


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # 2 shared cores: one thread per rank
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        fn(TPGroup.from_process_group(), *args)
        # Every rank done before any tears down: a rank that shuts gloo down while its peer
        # is still in a collective or its own teardown can abort that peer (seen once in CI:
        # "terminate called without an active exception").
        dist.barrier()
    finally:
        gc.collect()  # the model's reference cycles go now, not in interpreter finalization
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args) -> None:
    """Runs `fn(tp, *args)` on `world` spawned ranks; a rank's exception fails the caller."""
    mp.spawn(_entry, args=(world, free_ports(1)[0], fn, args), nprocs=world, join=True)


@contextmanager
def replay_selections(reference: dict[str, list] | None = None):
    """Records the model's discrete choices in call order: every DSA top-k selection (slot ids)
    and every MoE routing (weights, expert ids). Given a previous run's record, the model is fed
    those instead of its own (still recorded), so two runs whose values differ by roundings cannot
    part at a near-tied choice (`selections_differ` counts where they would have)."""
    rec: dict[str, list] = {"topk": [], "route": []}

    def replayed(key: str, inner: Callable) -> Callable:
        def f(*a, **kw):
            out = inner(*a, **kw)
            rec[key].append(tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone())
            if reference is None:
                return out
            old = reference[key][len(rec[key]) - 1]
            return tuple(t.clone() for t in old) if isinstance(old, tuple) else old.clone()

        return f

    inner_topk, inner_route = model_mod.dsa_topk_paged, moe_mod.route
    model_mod.dsa_topk_paged, moe_mod.route = replayed("topk", inner_topk), replayed("route", inner_route)
    try:
        yield rec
    finally:
        model_mod.dsa_topk_paged, moe_mod.route = inner_topk, inner_route


@contextmanager
def record_topk():
    """Collects every top-k selection (slot ids) the model makes, in call order."""
    with replay_selections() as rec:
        yield rec["topk"]


def selections_differ(a: dict[str, list], b: dict[str, list]) -> dict[str, float]:
    """Per kind, the fraction of rows (tokens) whose selected set differs between two records."""
    out = {}
    for key, pick in (("topk", lambda o: o), ("route", lambda o: o[1])):
        rows = [(pick(x).sort(-1).values != pick(y).sort(-1).values).any(-1) for x, y in zip(a[key], b[key])]
        assert len(a[key]) == len(b[key]) and rows, key
        out[key] = torch.cat(rows).float().mean().item()
    return out


def scenario(runner: ModelRunner, pick: Callable[[list[torch.Tensor]], list[int]]) -> dict:
    """Three prompts longer than index_topk, prefilled together in 16-token chunks on scattered
    pages, then batched greedy decode steps; `pick` turns each step's last-row logits into the
    next tokens. Returns every step's logits, the tokens and the top-k selections."""
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (3 * TOPK + 5, 5 * TOPK + 3, 7 * TOPK)]
    alloc = PageAllocator(PAGES)
    held = [alloc.alloc(1) for _ in range(40)]
    for h in held[::2]:
        alloc.free(h)  # fragment the free list: requests get scattered pages
    pages = [alloc.alloc(runner.pages_needed(len(p) + DECODE_STEPS)) for p in prompts]
    logits: list[torch.Tensor] = []
    tokens: list[list[int]] = []
    with record_topk() as topk:
        last: dict[int, torch.Tensor] = {}  # each prompt's final prefill row predicts its first token
        for s in range(0, max(map(len, prompts)), CHUNK):
            live = [i for i, p in enumerate(prompts) if s < len(p)]
            out = runner.forward([SeqChunk(prompts[i][s : s + CHUNK], s, pages[i], all_logits=True) for i in live])
            logits.extend(out)
            last.update({i: o[-1] for i, o in zip(live, out) if s + CHUNK >= len(prompts[i])})
        tok = pick([last[i] for i in range(len(prompts))])
        for j in range(DECODE_STEPS):
            tokens.append(tok)
            out = runner.forward([SeqChunk([t], len(p) + j, pg) for t, p, pg in zip(tok, prompts, pages)])
            logits.extend(out)
            tok = pick([o[-1] for o in out])
        tokens.append(tok)
    return {"logits": logits, "tokens": tokens, "topk": topk}


def greedy(rows: list[torch.Tensor]) -> list[int]:
    return [int(r.argmax()) for r in rows]


def greedy_from_rank0(tp: TPGroup) -> Callable[[list[torch.Tensor]], list[int]]:
    """What the scheduler does: sample once from rank 0's logits, send the tokens to every rank."""

    def pick(rows: list[torch.Tensor]) -> list[int]:
        t = torch.tensor(greedy(rows), dtype=torch.long)
        dist.broadcast(t, src=0, group=tp.process_group)
        return t.tolist()

    return pick


class ReadRecorder:
    """Wraps `safe_open` in the weights module and records, per tensor name, the shape of every
    tensor materialised from the file (a whole `get_tensor` or one `get_slice(...)[...]`)."""

    def __init__(self):
        self.reads: list[tuple[str, tuple[int, ...], bool]] = []  # (name, shape, whole)
        self._inner = weights_mod.safe_open

    def __enter__(self) -> "ReadRecorder":
        rec, inner = self, self._inner

        class Slice:
            def __init__(self, name, sl):
                self.name, self.sl = name, sl

            def get_shape(self):
                return self.sl.get_shape()

            def __getitem__(self, idx):
                t = self.sl[idx]
                rec.reads.append((self.name, tuple(t.shape), False))
                return t

        class File:
            def __init__(self, *a, **kw):
                self.f = inner(*a, **kw)

            def __enter__(self):
                self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                return Slice(name, self.f.get_slice(name))

            def get_tensor(self, name):
                t = self.f.get_tensor(name)
                rec.reads.append((name, tuple(t.shape), True))
                return t

        weights_mod.safe_open = File
        return self

    def __exit__(self, *exc) -> None:
        weights_mod.safe_open = self._inner


def checkpoint_rules(model: torch.nn.Module, names) -> dict[str, Shard]:
    """The shard rule that applies to each checkpoint tensor name."""
    params = dict(model.named_parameters())
    return {n: shard_of(params[param_of(n)[0]]) for n in names}


def check_reads(model: torch.nn.Module, reads: list[tuple[str, tuple[int, ...], bool]]) -> None:
    """Every checkpoint tensor this rank holds is read once: split ones as this rank's slice only,
    replicated ones whole, so the bytes read are the replicated bytes plus 1/size of the split
    ones; another expert-parallel rank's experts are never read."""
    tensors = checkpoint_tensors(model)
    rules = checkpoint_rules(model, tensors)
    held = {n for n in tensors if param_of(n)[1] is None or rules[n].holds_expert(param_of(n)[1])}
    by_name = {}
    for name, shape, whole in reads:
        assert name not in by_name, f"{name} read twice"
        by_name[name] = (shape, whole)
    assert set(by_name) == held, sorted(set(by_name) ^ held)[:8]
    for name in held:
        full, _ = tensors[name]
        shape, whole = by_name[name]
        rule = rules[name]
        if rule.replicated:
            assert whole and shape == full, name
        else:
            assert not whole and shape == rule.local_shape(full) != full, f"{name}: read {shape} of {full}"
