"""Logprobs on the instances: what a request asks for, computed from the logits at hand.

A logprob is log_softmax of the model's raw logits (float32), before temperature, penalties,
logit_bias or top-k/top-p (vLLM's default "raw" mode): the model's own probability of the token,
whatever the request's sampling did. Prefill computes the first token's (from the last prompt
position) and the prompt's (every position's logits, one chunk at a time: the [chunk, V] logits
are reduced to floats before the next chunk runs); decode computes the rest from the logits it
samples or verifies with (under DFlash: the target's verify logits of the committed tokens).

The first token's logprobs travel to decode inside the KV commit record (`MetadataRow.payload`),
packed by `pack_first` (float32 / int32, a few hundred bytes per choice), so decode's token
events carry every token's logprobs uniformly.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from glm53.server.protocol import MAX_CHOICES, MAX_TOP_LOGPROBS
from glm53.server.sampling import token_logprobs

_HDR = struct.Struct("<ii")  # choices, top-k


def meta_slot_bytes() -> int:
    """A metadata slot that holds MAX_CHOICES first tokens with MAX_TOP_LOGPROBS logprobs each."""
    per_choice = 4 + 4 + MAX_TOP_LOGPROBS * 8  # token id (row), logprob, top (id, logprob) pairs
    return 1024 + _HDR.size + MAX_CHOICES * per_choice


def pack_first(logprobs: Sequence[float], tops: Sequence[Sequence[tuple[int, float]]]) -> bytes:
    """The first tokens' logprobs (one per choice) and their top-k pairs, as bytes."""
    n = len(logprobs)
    k = len(tops[0]) if n else 0
    ids = np.array([[t for t, _ in row] for row in tops], dtype=np.int32).reshape(n, k)
    vals = np.array([[v for _, v in row] for row in tops], dtype=np.float32).reshape(n, k)
    return _HDR.pack(n, k) + np.asarray(logprobs, dtype=np.float32).tobytes() + ids.tobytes() + vals.tobytes()


def unpack_first(payload: bytes) -> tuple[list[float], list[list[list]]]:
    """`pack_first`'s inverse: logprobs [n] and top pairs [n][k] as [id, logprob] lists."""
    n, k = _HDR.unpack_from(payload, 0)
    off = _HDR.size
    lps = np.frombuffer(payload, dtype=np.float32, count=n, offset=off).tolist()
    off += 4 * n
    ids = np.frombuffer(payload, dtype=np.int32, count=n * k, offset=off).reshape(n, k).tolist()
    off += 4 * n * k
    vals = np.frombuffer(payload, dtype=np.float32, count=n * k, offset=off).reshape(n, k).tolist()
    return lps, [[[i, v] for i, v in zip(ri, rv)] for ri, rv in zip(ids, vals)]


def rows_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> tuple[list[float], list[list[list]]]:
    """Per row of raw logits [R, V]: the logprob of its token and its `top` (id, logprob) pairs."""
    lps, tops = token_logprobs(logits, list(token_ids), top)
    return lps, [[[int(i), float(v)] for i, v in row] for row in tops]


@dataclass
class PromptLogprobs:
    """Prompt logprobs of one request, gathered chunk by chunk on prefill. Entry j is prompt
    position start + j: the logprob of that token given the tokens before it (None at
    position 0), with its top-k pairs."""

    input_ids: Sequence[int]
    start: int
    top: int
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[list[list]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.start == 0:
            self.logprobs.append(None)
            self.tops.append([])

    def add_chunk(self, logits: torch.Tensor, first_pos: int) -> None:
        """`logits` [k, V]: rows for prompt positions first_pos .. first_pos + k - 1; row i
        predicts the token at position first_pos + i + 1 (the last prompt row predicts the
        first output token and is not a prompt logprob)."""
        T = len(self.input_ids)
        lo = max(first_pos, self.start - 1, 0)  # rows whose predicted position is wanted
        hi = min(first_pos + logits.shape[0], T - 1)
        if hi <= lo:
            return
        rows = logits[lo - first_pos: hi - first_pos]
        lps, tops = rows_logprobs(rows, self.input_ids[lo + 1: hi + 1], self.top)
        self.logprobs.extend(lps)
        self.tops.extend(tops)
