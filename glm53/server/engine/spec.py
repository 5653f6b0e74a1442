"""Speculative verification: which of a block's draft tokens a request commits.

The verify forward gives the target's logits at every block position: row i (i = 0..n) predicts
the token after block token i, where block token 0 is the last committed token and tokens 1..n
are the drafts d_1..d_n. Greedy: commit the longest prefix of drafts equal to the target's argmax,
then the target's token at the first mismatch (or after the last draft) — exactly what
non-speculative greedy decoding emits. Sampled (temperature > 0): the drafts come from the
draft's argmax, a point mass, so accepting d_i with probability p_i(d_i) and, on rejection,
drawing from p_i with d_i removed gives exactly the target distribution p_i (after temperature,
top-k, top-p and min-p, as the non-speculative sampler applies them): lossless rejection
sampling. The bonus token after a fully accepted block is drawn from p_n.

Penalties, logit_bias and min_new_tokens stay exact: row i is adjusted with the history the
non-speculative sampler would see at that position (the committed output plus d_1..d_i), which
is the history whenever row i is used, since row i only matters once d_1..d_i are accepted.
"""

from __future__ import annotations

from typing import Sequence

import torch

from glm53.server.sampling import SamplingParams, TokenHistory, adjust_logits, filter_logits, step_generator


def accept(drafts: Sequence[int], logits: torch.Tensor, params: SamplingParams, first_step: int,
           history: TokenHistory | None = None, choice: int = 0, argmax: Sequence[int] | None = None) -> list[int]:
    """The tokens to commit (1..len(drafts)+1 of them) for one request. `logits` is [n+1, V];
    `first_step` is the output position of the first token committed here (seeded requests draw
    position j's randomness from `step_generator(seed, j, choice=choice)`, as non-speculative
    decoding does). `history` (prompt, output so far, stop ids) is needed when the params adjust
    the logits. `argmax`: each row's argmax of these very logits, already on the host (the step
    read it with the drafts, one copy for the batch); greedy requests whose logits nothing
    adjusts accept from it instead of reading the rows."""
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
            target = logits.argmax(dim=-1).tolist()
        out = []
        for d, t in zip(drafts, target):
            if d != t:
                break
            out.append(d)
        out.append(target[len(out)])
        return out
    probs = torch.softmax(filter_logits(logits.float() / params.temperature, [params] * (n + 1)), dim=-1)
    if params.seed is not None:
        probs = probs.cpu()  # step_generator's generators are CPU ones: draw there, on any device
    out = []
    for i in range(n + 1):
        g = step_generator(params.seed, first_step + i, choice=choice) if params.seed is not None else None
        p = probs[i]
        if i == n:  # every draft accepted: the bonus token from the last row
            out.append(int(torch.multinomial(p, 1, generator=g)))
            return out
        d = int(drafts[i])
        u = float(torch.rand((), generator=g))
        if u < float(p[d]):
            out.append(d)
            continue
        rest = p.clone()
        rest[d] = 0.0
        out.append(int(torch.multinomial(rest / rest.sum(), 1, generator=g)))
        return out
    return out
