"""References of the e2e tests, computed with the model core in this process: log_softmax at
every position (`ref_logsoftmax`, compared within `TOL`) and greedy decoding with the per-token
reference adjustment of penalties / logit_bias / min_tokens (`reference_greedy`)."""

from __future__ import annotations

import torch

from glm53.models import ModelRunner, PageAllocator, SeqChunk
from glm53.server.sampling import SamplingParams, TokenHistory
from tests.server.reference_sampling import reference_adjust

TOL = 2e-3  # float32 on both sides; chunked prefill vs one forward


def ref_logsoftmax(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """log_softmax of the reference model's logits at every position of `ids` ([T, V])."""
    pages = PageAllocator(64).alloc(runner.pages_needed(len(ids)))
    with torch.no_grad():
        lg = runner.forward([SeqChunk(ids, 0, pages, all_logits=True)])[0]
    return torch.log_softmax(lg.double(), -1)


def reference_greedy(runner: ModelRunner, prompt: list[int], p: SamplingParams, stop_ids: list[int],
                     new: int) -> list[int]:
    """Greedy decoding with the reference model and the per-token reference adjustment."""
    out: list[int] = []
    pages = PageAllocator(64).alloc(runner.pages_needed(len(prompt) + new))
    chunk = SeqChunk(prompt, 0, pages)
    for _ in range(new):
        # Penalties act on the raw logits (a division by the repetition penalty does not commute
        # with log_softmax's per-row shift), so the reference adjusts the raw logits too.
        with torch.no_grad():
            raw = runner.forward([chunk])[0][-1]
        adj = reference_adjust(raw.tolist(), p, TokenHistory(prompt, out, stop_ids))
        out.append(max(range(len(adj)), key=lambda t: (adj[t], -t)))
        chunk = SeqChunk([out[-1]], len(prompt) + len(out) - 1, pages)  # the cache holds the rest
    return out
