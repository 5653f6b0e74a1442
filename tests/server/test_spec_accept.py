"""Speculative verification (server/engine/spec.py): greedy commits exactly what greedy decoding
would, and sampled verification is lossless — the committed tokens follow the target's filtered
distribution whatever the draft proposed (chi-square over many seeds on a tiny vocabulary)."""

from __future__ import annotations

import math

import pytest
import torch

from glm53.server.engine.spec import accept
from glm53.server.sampling import SamplingParams, filter_logits

V = 6


def test_greedy_commits_the_matching_prefix_and_the_target_token():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g)
    target = logits.argmax(-1).tolist()
    p = SamplingParams(temperature=0.0)
    assert accept(target[:4], logits, p, 0) == target  # all accepted, plus the bonus
    wrong = (target[1] + 1) % V
    assert accept([target[0], wrong, target[2], target[3]], logits, p, 0) == target[:2]
    assert accept([(target[0] + 1) % V] * 4, logits, p, 0) == target[:1]
    assert accept([], logits[:1], p, 0) == target[:1]
    with pytest.raises(ValueError, match="rows"):
        accept([1, 2], logits, p, 0)
    # the argmaxes the step read with the drafts: used instead of reading the logits...
    assert accept(target[:4], logits, p, 0, argmax=target) == target
    other = [(t + 1) % V for t in target]
    assert accept(other[:4], logits, p, 0, argmax=other) == other
    # ...but not when the logits are adjusted (the argmaxes are of the raw logits)
    from glm53.server.sampling import TokenHistory

    biased = SamplingParams(temperature=0.0, logit_bias={other[0]: -100.0})
    hist = TokenHistory(torch.tensor([0]), [], [])
    assert accept(other[:4], logits, biased, 0, history=hist, argmax=other)[0] != other[0]


def chi_square_p(counts: list[int], probs: list[float]) -> float:
    """Upper-tail p-value of Pearson's statistic (Wilson–Hilferty approximation)."""
    n = sum(counts)
    cells = [(c, n * q) for c, q in zip(counts, probs) if q > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    k = len(cells) - 1
    if k == 0:  # one possible outcome: everything must be it
        return 1.0 if cells[0][0] == n else 0.0
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.3, top_k=4),
                                dict(temperature=1.0, top_p=0.8), dict(temperature=0.9, min_p=0.1)])
def test_sampled_verification_is_lossless(kw):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 1.5
    params = [SamplingParams(seed=s, **kw) for s in range(2000)]
    target = torch.softmax(filter_logits(logits / params[0].temperature, [params[0]] * 3), -1)
    # A draft that proposes the target's most likely token first, then an unlikely one: the
    # first committed token and (when the first draft is accepted) the second must each follow
    # the target's distribution at their position.
    drafts = [int(target[0].argmax()), int(target[1].argmin())]
    first = [0] * V
    second = [0] * V
    for p in params:
        toks = accept(drafts, logits, p, first_step=p.seed * 10)
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            second[toks[1]] += 1
    assert chi_square_p(first, target[0].tolist()) > 1e-3, (first, target[0])
    assert chi_square_p(second, target[1].tolist()) > 1e-3, (second, target[1])
    # Filtered-out tokens are never committed.
    assert all(c == 0 for c, q in zip(first, target[0].tolist()) if q == 0)


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.0, top_p=0.8),
                                dict(temperature=1.5, top_k=4, top_p=0.9, min_p=0.05)])
def test_sampled_drafting_is_lossless(kw):
    """The whole sampled path: DSpark's drafter (models/dspark.choose_block, its Markov bias on
    the *sampled* predecessor) samples two-token blocks from its own q under the request's
    filters, and accept keeps d with min(1, p/q), else resamples from norm(max(0, p − q)). The
    committed tokens follow p at both positions, and the first draft is accepted Σ min(p, q) of
    the time — more than the p(argmax q) of an argmax proposal."""
    from glm53.models.dspark import BlockSampling, MarkovHead, choose_block

    n = 2000
    g = torch.Generator().manual_seed(2)
    target_logits = torch.randn(3, V, generator=g) * 1.5
    draft_logits = target_logits[:2] + torch.randn(2, V, generator=g)  # a draft that is close, not equal
    markov = MarkovHead(V, 3, torch.float32)
    markov.markov_w1.weight.copy_(torch.randn(V, 3, generator=g) * 0.7)
    markov.markov_w2.weight.copy_(torch.randn(V, 3, generator=g) * 0.7)
    p0 = SamplingParams(**kw)
    s = BlockSampling(rows=torch.ones(n, dtype=torch.bool), temperature=torch.full((n,), p0.temperature),
                      top_k=torch.full((n,), p0.top_k if p0.top_k > 0 else V), top_p=torch.full((n,), p0.top_p),
                      min_p=torch.full((n,), p0.min_p), uniforms=torch.rand(n, 2, dtype=torch.float64, generator=g))
    anchor = torch.full((n,), 1)
    choice = choose_block(draft_logits.expand(n, 2, V), anchor, markov=markov, sampling=s)
    target = torch.softmax(filter_logits(target_logits / p0.temperature, [p0] * 3), -1)
    first, second, accepted = [0] * V, [0] * V, 0
    for i in range(n):
        d = choice.tokens[i].tolist()
        toks = accept(d, target_logits, SamplingParams(seed=i, **kw), first_step=0, q=choice.probs[i])
        first[toks[0]] += 1
        if len(toks) > 1:  # the first draft was accepted: the second token must follow p_1
            accepted += 1
            second[toks[1]] += 1
    assert chi_square_p(first, target[0].tolist()) > 1e-3, (first, target[0])
    assert chi_square_p(second, target[1].tolist()) > 1e-3, (second, target[1])
    for counts, row in ((first, target[0]), (second, target[1])):  # filtered-out tokens never committed
        assert all(c == 0 for c, q in zip(counts, row.tolist()) if q == 0)
    # q of the first position (the anchor is fixed, so it is one distribution for every row)
    q0 = choice.probs[0, 0]
    want = float(torch.minimum(target[0], q0).sum())
    assert abs(accepted / n - want) < 4 * math.sqrt(want * (1 - want) / n), (accepted / n, want)
    assert want > float(target[0, int(q0.argmax())])
