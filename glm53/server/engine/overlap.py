"""The overlapped decode loop's units: one decode step launched and not yet read back (plain:
`InflightStep`; speculative: `InflightSpec`).

A GPU decode step is short (~2 ms on the GLM-5 slice) and the scheduler's host work around it
(building the batch, reading tokens back, committing and streaming them) is not: done in series,
the GPU idles through it. The decode scheduler therefore launches step k + 1 before it reads
step k's tokens: step k + 1's inputs are step k's samples, which stay on the device
(`DeviceTokens`), and step k's copy to the host is waited for only after step k + 1 is queued.

What that costs is decided in `DecodeScheduler` (engine/decode.py): a request that ends at
step k (a stop token) has already been launched into step k + 1, whose result for it is dropped;
its pages are freed only once step k + 1 has run, since that step still writes them. Only plain
rows overlap, greedy or sampled without a seed (no penalties, logprobs or grammar: those need
each step's tokens on the host before the next step); any other row drains the pipeline first.

A speculative step (DFlash, DSpark) overlaps the same way for greedy rows: its graph leaves the
state's rows where greedy acceptance moves them (models/spec_state.py, `advance`), so step k + 1
launches on the device's rows while the host reads and commits step k's accepted tokens, which are
the same ones (`greedy_prefix` of the same drafts and argmaxes). The host only bounds where the
rows can be (each step moves a row by at most K) to pick a graph wide enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm53.server.engine.spec import greedy_prefix, plain_greedy
from glm53.server.sampling import sample


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A copy of `t` on the host and the event after which it is valid: on CUDA a pinned,
    non-blocking copy queued behind the work that writes `t` (no sync); else a plain copy."""
    if not t.is_cuda:
        return t.clone(), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class _Launched:
    """What both in-flight kinds share: the step's requests in row order (`batch`) and the host
    copy of its output (`host`, valid once `done` has run; `done` None: the copy was synchronous)."""

    batch: list
    host: torch.Tensor
    done: torch.cuda.Event | None

    def holds(self, r) -> bool:
        return any(x is r for x in self.batch)

    def _read(self) -> list:
        """The host copy as lists, waiting for the GPU if it is still running."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


@dataclass
class InflightStep(_Launched):
    batch: list  # the step's requests, in row order
    tokens: torch.Tensor  # [n] long on the device: each row's sample
    host: torch.Tensor  # [n] long on the host (pinned on CUDA): their copy, valid once `done` ran
    done: torch.cuda.Event | None  # recorded after the copy (CUDA); None: the copy was synchronous

    @classmethod
    def launch(cls, batch: list, logits: torch.Tensor) -> "InflightStep":
        """Queue the samples of `logits` [n, vocab] (each row by its request's params) and their
        copy to the host; returns at once on CUDA."""
        tokens = sample(logits, [r.params for r in batch])
        return cls(batch, tokens, *to_host(tokens))

    def row_of(self) -> dict[int, int]:
        """id(request) -> its row."""
        return {id(r): i for i, r in enumerate(self.batch)}

    def result(self) -> list[int]:
        """The step's tokens, waiting for the GPU if it is still running."""
        return self._read()


@dataclass
class InflightSpec(_Launched):
    batch: list  # the step's requests, in row order
    host: torch.Tensor  # [n, 2K] long on the host (pinned on CUDA): drafts, verify argmaxes, verified count
    done: torch.cuda.Event | None  # recorded after the copy (CUDA); None: the copy was synchronous
    starts: list[int]  # per row: the host's bound on the step's start position (exact on a fresh launch)

    @classmethod
    def launch(cls, batch: list, tokens: torch.Tensor, starts: list[int]) -> "InflightSpec":
        """Queue the copy of a launched step's `tokens` [n, 2K] to the host (before the next
        launch overwrites the graph's output); returns at once on CUDA."""
        return cls(batch, *to_host(tokens), starts)

    @property
    def k(self) -> int:
        return self.host.shape[1] // 2

    def same_batch(self, batch: list) -> bool:
        return len(batch) == len(self.batch) and all(a is b for a, b in zip(batch, self.batch))

    def result(self) -> list[list[int]]:
        """Per row, the tokens greedy acceptance commits, waiting for the GPU if it is still running."""
        k = self.k
        out = []
        for t in self._read():
            n = t[-1]
            out.append(greedy_prefix(t[: n - 1], t[k - 1 : k - 1 + n]))
        return out


def overlappable(r) -> bool:
    """A decode request whose next input can stay on the device: nothing needs each step's token
    or logits on the host first (penalties and logit_bias read the history, logprobs the logits
    row, a grammar its state) and its draw needs no host generator (a seed's noise is drawn on
    the CPU)."""
    p = r.params
    return (p.greedy or p.seed is None) and not p.adjusts and r.constraint is None and r.req.spec.logprobs < 0


def spec_overlappable(r) -> bool:
    """A decode request whose speculative steps can overlap: plain greedy (it commits
    `greedy_prefix` of a step's drafts and argmaxes, which is what `SpecState.advance` assumed on
    the device) and no logprobs to read from each step's logits."""
    return plain_greedy(r) and r.req.spec.logprobs < 0
