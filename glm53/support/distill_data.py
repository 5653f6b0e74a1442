"""Training data for the self-distilled DFlash draft of tools/distill_draft.py: the frozen target's
own continuations and its features, generated with the serving model (`glm53.models`, float32).

A round continues `n` prompts of one length in lockstep: every sequence is at the same position, so
a decode step is one `ForwardBatch` built on the device (no per-sequence Python, no host sync
besides the step's sampled tokens staying on the device). Each forward also captures the draft's
feature layers (`target_layer_ids`): the features a training context needs are exactly the ones the
serving runner writes into the draft KV (the output of layer `id` for each committed token), so
training needs no second target forward. Features are kept in bf16 in one preallocated buffer.

Round kinds cycle through `kinds`: greedy; T = 1 sampling for the first `SAMPLED_HEAD` tokens
then greedy (states away from the corpus, greedy labels); T = 0.8 throughout (for sampled
serving). `anchor_start` gives the first anchor whose labels are the target's own tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from glm53.support.training import log

SAMPLED_HEAD = 24
TEMPERATURE = {"greedy": lambda step: 0.0, "sampled head": lambda step: 1.0 if step < SAMPLED_HEAD else 0.0,
               "sampled": lambda step: 0.8}


def anchor_start(plen: int, kind: str) -> int:
    """First anchor whose next tokens are the target's own (greedy, or sampled for "sampled"):
    the anchor token may be the prompt's last."""
    return plen - 1 + (SAMPLED_HEAD if kind == "sampled head" else 0)


@dataclass
class Data:
    """`tokens` [M, S], `feats` [M, S, K·H] bf16 (position S − 1 zero: never fed), `starts` [M]
    first valid anchor, `greedy` [M] labels are greedy, `plen` [M] prompt length; `m` rows filled."""

    tokens: torch.Tensor
    feats: torch.Tensor
    starts: torch.Tensor
    greedy: torch.Tensor
    plen: torch.Tensor
    m: int = 0

    @classmethod
    def empty(cls, rows: int, seq: int, width: int, device) -> "Data":
        return cls(torch.zeros(rows, seq, dtype=torch.long, device=device),
                   torch.empty(rows, seq, width, dtype=torch.bfloat16, device=device),
                   torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.bool),
                   torch.zeros(rows, dtype=torch.long))

    def head(self, m: int) -> "Data":
        m = min(m, self.m)
        return Data(self.tokens[:m], self.feats[:m], self.starts[:m], self.greedy[:m], self.plen[:m], m)

    def view(self) -> "Data":
        return self.head(self.m)


def _batch(ids, pos, rows, table, ps: int, max_context: int):
    from glm53.models.model import ForwardBatch

    page = table[rows, pos // ps].to(torch.long)
    return ForwardBatch(input_ids=ids, positions=pos, out_slots=page * ps + pos % ps, page_table=table[rows],
                        context_lens=(pos + 1).to(torch.int32), max_context=max_context)


@torch.no_grad()
def generate(runner, prompts: torch.Tensor, kind: str, g: torch.Generator, tokens: torch.Tensor,
             feats: torch.Tensor, layer_ids, prefill_rows: int = 128) -> None:
    """Continue `prompts` [n, P] (device) to `tokens.shape[1]` tokens in lockstep, writing the
    sequences into `tokens` [n, S] and the features of every fed position into `feats` [n, S, K·H]."""
    n, plen = prompts.shape
    total = tokens.shape[1]
    model, pools, ps = runner.model, runner.pools, runner.page_size
    dev = prompts.device
    npg = -(-total // ps)
    if n * npg > pools.num_pages:
        raise ValueError(f"{n} sequences of {total} tokens need {n * npg} pages, the pools hold {pools.num_pages}")
    table = torch.arange(n * npg, dtype=torch.int32, device=dev).view(n, npg)
    tokens[:, :plen] = prompts

    def run(batch, rows: int, width: int):
        out = model.forward_stage(batch, pools, None, capture=layer_ids)
        f = torch.cat([out.captures[i] for i in layer_ids], -1).view(rows, width, -1)
        return out.hidden, f

    last = []
    for s in range(0, n, prefill_rows):  # prefill in groups: a bounded attention workspace
        e = min(n, s + prefill_rows)
        pos = torch.arange(plen, device=dev).repeat(e - s)
        rows = torch.arange(s, e, device=dev).repeat_interleave(plen)
        hidden, f = run(_batch(prompts[s:e].reshape(-1), pos, rows, table, ps, plen), e - s, plen)
        feats[s:e, :plen] = f
        last.append(model.logits(hidden.view(e - s, plen, -1)[:, -1]))
    logits = torch.cat(last)
    every = torch.arange(n, device=dev)
    for p in range(plen, total):
        temp = TEMPERATURE[kind](p - plen)
        if temp == 0.0:
            tokens[:, p] = logits.argmax(-1)
        else:
            tokens[:, p] = torch.multinomial(torch.softmax(logits / temp, -1), 1, generator=g).squeeze(1)
        if p == total - 1:
            break
        pos = torch.full((n,), p, dtype=torch.long, device=dev)
        hidden, f = run(_batch(tokens[:, p], pos, every, table, ps, p + 1), n, 1)
        feats[:, p] = f[:, 0]
        logits = model.logits(hidden)
    feats[:, total - 1] = 0


def build(runner, stream: torch.Tensor, data: Data, *, n: int, seconds: float, rounds: int, seed: int,
          kinds, lens, layer_ids, first: list[list[int]] = ()) -> None:
    """Rounds of `n` generated sequences into `data` until `rounds` (if set), `seconds`, or the
    buffer's capacity is spent. Prompts: random windows of `stream`, one length a round; the
    first round's first prompts are `first` (of that length) when given."""
    dev = data.tokens.device
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(device=dev).manual_seed(seed)
    S = data.tokens.shape[1]
    t0 = time.time()
    r, last = 0, 0.0
    # by time: start a round only if one as long as the last still fits the budget
    while data.m + n <= len(data.tokens) and ((r < rounds) if rounds else (time.time() - t0 + last <= seconds or r == 0)):
        t1 = time.time()
        kind = kinds[r % len(kinds)]
        plen = lens[int(torch.randint(len(lens), (), generator=g))]
        at = torch.randint(0, len(stream) - plen, (n,), generator=g)
        prompts = torch.stack([stream[s: s + plen] for s in at.tolist()])
        if r == 0 and first:
            prompts[: len(first)] = torch.tensor(first[:n], dtype=torch.long)[:, :plen]
        prompts = prompts.to(dev)
        sl = slice(data.m, data.m + n)
        generate(runner, prompts, kind, gd, data.tokens[sl], data.feats[sl], layer_ids)
        data.starts[sl] = anchor_start(plen, kind)
        data.greedy[sl] = kind != "sampled"
        data.plen[sl] = plen
        data.m += n
        r += 1
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt, last = time.time() - t0, time.time() - t1
        log(f"gen round {r:3d}: {kind:<12} prompt {plen:3d} -> {S} tokens x {n}, "
            f"{data.m * (S - 1) / dt / 1e3:.1f}K tok/s fed, {dt:.0f}s")
    gen = int(sum(S - p for p in data.plen[: data.m].tolist()))
    log(f"generated {r} rounds ({data.m} sequences, {gen} generated tokens, {data.m * S} in all) "
        f"in {time.time() - t0:.0f}s")


@torch.no_grad()
def label_agreement(target_dir, data: Data, dtype: torch.dtype, device, rows: int = 64) -> float:
    """Teacher-forced: the fraction of greedy generated tokens that a `dtype` copy of the target,
    fed the same sequences in one prefill, also takes as its argmax (how often generating in
    `dtype` would change the labels)."""
    from glm53.models import ModelRunner

    S = data.tokens.shape[1]
    n = min(rows, data.m)
    r = ModelRunner.from_dir(target_dir, page_size=16, num_pages=n * -(-S // 16) + 1, device=str(device),
                             dtype=dtype, progress=False)
    x = data.tokens[:n]
    table = torch.arange(n * -(-S // 16), dtype=torch.int32, device=x.device).view(n, -1)
    pos = torch.arange(S, device=x.device).repeat(n)
    rows_ = torch.arange(n, device=x.device).repeat_interleave(S)
    out = r.model.forward_stage(_batch(x.reshape(-1), pos, rows_, table, 16, S), r.pools, None)
    pred = r.model.logits(out.hidden).argmax(-1).view(n, S)[:, :-1]
    lab = x[:, 1:]
    ok = torch.arange(S - 1, device=x.device)[None] >= data.starts[:n, None].to(x.device)
    ok &= data.greedy[:n, None].to(x.device)
    return ((pred == lab) & ok).sum().item() / max(1, ok.sum().item())
