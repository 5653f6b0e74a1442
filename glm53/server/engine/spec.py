"""Speculative verification: which of a block's draft tokens a request commits.

The verify forward gives the target's logits at every block position: row i (i = 0..n) predicts
the token after block token i, where block token 0 is the last committed token and tokens 1..n
are the drafts d_1..d_n. Greedy: commit the longest prefix of drafts equal to the target's argmax,
then the target's token at the first mismatch (or after the last draft) — exactly what
non-speculative greedy decoding emits. Sampled (temperature > 0): the drafts were sampled from the
draft's own distribution q_i (its logits under the request's temperature, top-k, top-p and min-p;
DSpark's conditioned on the sampled predecessor), so d_i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)) and, on rejection, the token is drawn from norm(max(0, p_i − q_i)):
exactly the target distribution p_i (after temperature, top-k, top-p and min-p, as the
non-speculative sampler applies them), and Σ min(p, q) of the time the draft's token. Drafts that
are the draft's argmax (no q: the CUDA-graph step, or sampled drafting off) are a point mass: accept
with probability p_i(d_i), else draw from p_i with d_i removed — the same rule with q one-hot.
The bonus token after a fully accepted block is drawn from p_n.

Penalties, logit_bias and min_new_tokens stay exact: row i is adjusted with the history the
non-speculative sampler would see at that position (the committed output plus d_1..d_i), which
is the history whenever row i is used, since row i only matters once d_1..d_i are accepted.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from glm53.models.draft import DraftSampling
from glm53.models.readback import readback
from glm53.server.sampling import SamplingParams, TokenHistory, adjust_logits, filter_logits, step_generator

_DRAFT_SALT = 0x5DEECE66D  # the draft's seed stream differs from the verify's step_generator stream


def draft_sampling(params: SamplingParams, step: int, choice: int, rng: random.Random) -> DraftSampling | None:
    """How a request's next block is drafted: None (the draft's argmax) for a greedy request, else
    sampled under its temperature and filters. A seeded request's draft seed follows from (seed,
    output position `step`, choice), so its drafts, and so its output, repeat; an unseeded one
    takes a fresh seed from the scheduler's `rng` (one seed per block, sent to every rank)."""
    if params.greedy:
        return None
    if params.seed is not None:
        seed = int(torch.randint(0, 1 << 62, (), generator=step_generator(params.seed ^ _DRAFT_SALT, step,
                                                                             choice=choice)))
    else:
        seed = rng.getrandbits(62)
    return DraftSampling(params.temperature, max(params.top_k, 0), params.top_p, params.min_p, seed)


def plain_greedy(r) -> bool:
    """A greedy request (engine/decode_request.DecodeRequest) whose verify rows nothing adjusts or masks:
    it accepts from the argmaxes the step read back (`accept`'s own shortcut, taken without
    calling it)."""
    p = r.params
    return r.constraint is None and p.temperature == 0.0 and not p.adjusts


def greedy_prefix(drafts: Sequence[int], target: Sequence[int]) -> list[int]:
    """Greedy verification from the target's argmax of each verify row (`target`, n + 1 of them):
    the drafts up to the first that differs from the target's token, then the target's token
    there, i.e. target[: a + 1] for a accepted drafts."""
    a = 0
    for d, t in zip(drafts, target):
        if d != t:
            break
        a += 1
    return list(target[: a + 1])


def accept(drafts: Sequence[int], logits: torch.Tensor, params: SamplingParams, first_step: int,
           history: TokenHistory | None = None, choice: int = 0, argmax: Sequence[int] | None = None,
           q: torch.Tensor | None = None) -> list[int]:
    """The tokens to commit (1..len(drafts)+1 of them) for one request. `logits` is [n+1, V];
    `first_step` is the output position of the first token committed here (seeded requests draw
    position j's randomness from `step_generator(seed, j, choice=choice)`, as non-speculative
    decoding does). `history` (prompt, output so far, stop ids) is needed when the params adjust
    the logits. `argmax`: each row's argmax of these very logits, already on the host (the step
    read it with the drafts, one copy for the batch); greedy requests whose logits nothing
    adjusts accept from it instead of reading the rows. `q` [n, V]: the distributions the drafts
    were sampled from (None: they are the draft's argmax)."""
    n = len(drafts)
    if logits.shape[0] != n + 1:
        raise ValueError(f"verify logits must have {n + 1} rows for {n} drafts, got {logits.shape[0]}")
    if params.adjusts:
        if history is None:
            raise ValueError("penalties, logit_bias and min_new_tokens need the request's TokenHistory")
        out_so_far = list(history.output)
        hists = [TokenHistory(history.prompt, out_so_far + [int(d) for d in drafts[:i]], history.stop_ids)
                 for i in range(n + 1)]
        logits = adjust_logits(logits, [params] * (n + 1), hists)
    if params.greedy:
        if argmax is not None and not params.adjusts:
            if len(argmax) != n + 1:
                raise ValueError(f"argmax must have {n + 1} rows for {n} drafts, got {len(argmax)}")
            target = list(argmax)
        else:
            target = readback(logits.argmax(dim=-1)).tolist()
        return greedy_prefix(drafts, target)
    probs = torch.softmax(filter_logits(logits.float() / params.temperature, [params] * (n + 1)), dim=-1)
    if params.seed is not None:
        probs = probs.cpu()  # step_generator's generators are CPU ones: draw there, on any device
    if q is not None:
        if q.shape[0] != n:
            raise ValueError(f"q must have {n} rows for {n} drafts, got {q.shape[0]}")
        q = q.to(probs.device, torch.float32)
    out = []
    for i in range(n + 1):
        g = step_generator(params.seed, first_step + i, choice=choice) if params.seed is not None else None
        p = probs[i]
        if i == n:  # every draft accepted: the bonus token from the last row
            out.append(int(torch.multinomial(p, 1, generator=g)))
            return out
        d = int(drafts[i])
        u = float(torch.rand((), generator=g))
        if q is None:  # a point mass on d
            if u < float(p[d]):
                out.append(d)
                continue
            rest = p.clone()
            rest[d] = 0.0
        else:
            if u * float(q[i, d]) < float(p[d]):  # u < p(d) / q(d)
                out.append(d)
                continue
            rest = (p - q[i]).clamp_min(0.0)
        if float(rest.sum()) <= 0.0:  # a rejection leaves mass where p > q; rounding aside
            rest = p
        out.append(int(torch.multinomial(rest / rest.sum(), 1, generator=g)))
        return out
    return out
