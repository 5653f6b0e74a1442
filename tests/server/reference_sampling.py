"""A straightforward reference of the logit adjustments (penalties, logit_bias, min_new_tokens):
one row, one token at a time, in the documented order. Used by tests/server/test_penalties.py and
the e2e reference sampler (tests/e2e/reference.py)."""

import math
from collections import Counter

from glm53.server.sampling import SamplingParams, TokenHistory


def reference_adjust(row: list[float], p: SamplingParams, h: TokenHistory) -> list[float]:
    """One row, one token at a time, in the documented order."""
    x = list(row)
    for t, b in p.logit_bias.items():
        x[t] += b
    if len(h.output) < p.min_new_tokens:
        for t in h.stop_ids:
            x[t] = -math.inf
    seen = set(h.prompt) | set(h.output)
    counts = Counter(h.output)
    for t in range(len(x)):
        if t in seen and p.repetition_penalty != 1:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        c = counts[t]
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (1 if c else 0)
    return x
