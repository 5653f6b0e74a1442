"""Pipeline-parallel stages: what crosses a stage boundary, and how a stage runs micro-batches.

Across a boundary a micro-batch hands on exactly `StageInput`: the residual stream [N, H] (model
dtype), the top-k slots [N, k] (int32) when the next stage starts with "shared" indexer layers
whose source full layer ran upstream, and with a DFlash draft the fp32 accumulator [N, H] of the
draft's partial context projection (docs/ARCHITECTURE.md, "Capture and partial projection").
Nothing else: no feature concatenation crosses. A small header tensor says which are present and
their shapes, so the receiver never guesses.

Every tp rank of stage s sends to the same tp rank of stage s + 1 (the tensors are identical
across a stage's tp ranks after its all-reduces). Sends are asynchronous: a stage starts the
next micro-batch while the previous one's tensors travel, so with several micro-batches per
step stage s works on micro-batch m + 1 while stage s + 1 works on m.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from glm53.models import SeqChunk, StageInput, StageOutput
from glm53.models.readback import readback

_HEADER = 4  # tokens, hidden, top-k columns (0: none), draft accumulator present (0/1)


@dataclass
class StageStats:
    """One rank's running totals: seconds spent computing its stage (not waiting for the
    previous stage), and the bytes and tokens it sent across its outgoing boundary."""

    busy_s: float = 0.0
    bytes: int = 0
    tokens: int = 0


class StagePipe:
    """One rank's links to its neighbours in the pipeline (global ranks, None at the ends)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, dtype: torch.dtype, device: torch.device,
                 group: dist.ProcessGroup | None = None):
        self.prev, self.next, self.dtype, self.device, self.group = prev_rank, next_rank, dtype, device, group
        self.stats = StageStats()

    def send(self, out: StageOutput) -> list:
        """Start sending `out` to the next stage; the work handles (wait on them before the
        tensors may be reused)."""
        n, h = out.hidden.shape
        k = 0 if out.topk_slots is None else out.topk_slots.shape[1]
        header = torch.tensor([n, h, k, int(out.draft_acc is not None)], dtype=torch.long, device=self.device)
        tensors = [header, out.hidden.contiguous()]
        if out.topk_slots is not None:
            tensors.append(out.topk_slots.to(torch.int32).contiguous())
        if out.draft_acc is not None:
            tensors.append(out.draft_acc.float().contiguous())
        self.stats.bytes += sum(t.numel() * t.element_size() for t in tensors[1:])
        self.stats.tokens += n
        # Keep each tensor referenced by its handle until it is waited on.
        return [(dist.isend(t, self.next, group=self.group), t) for t in tensors]

    def recv(self) -> StageInput:
        header = torch.empty(_HEADER, dtype=torch.long, device=self.device)
        dist.recv(header, self.prev, group=self.group)
        n, h, k, acc = readback(header).tolist()
        hidden = torch.empty(n, h, dtype=self.dtype, device=self.device)
        dist.recv(hidden, self.prev, group=self.group)
        topk = None
        if k:
            topk = torch.empty(n, k, dtype=torch.int32, device=self.device)
            dist.recv(topk, self.prev, group=self.group)
        draft_acc = None
        if acc:
            draft_acc = torch.empty(n, h, dtype=torch.float32, device=self.device)
            dist.recv(draft_acc, self.prev, group=self.group)
        return StageInput(hidden, topk, draft_acc)


def run_microbatches(runner, pipe: StagePipe | None, microbatches: list[list[SeqChunk]],
                     stats: StageStats | None = None) -> list[list[torch.Tensor]] | None:
    """Run a step's micro-batches in order on this stage: receive each one's input from the
    previous stage, run the stage, hand the output on (asynchronously) — or, on the last stage,
    return every micro-batch's per-chunk logits. Without a pipe this is the whole model. Compute
    time goes into `stats.busy_s` (wall time of the stage's forwards; on CUDA, of their launches)."""
    last = pipe is None or pipe.next is None
    results, pending = [], []
    for chunks in microbatches:
        inputs = pipe.recv() if pipe is not None and pipe.prev is not None else None
        t0 = time.perf_counter()
        if last:
            results.append(runner.forward(chunks, inputs))
        else:
            pending.extend(pipe.send(runner.forward_stage(chunks, inputs)))
        if stats is not None:
            stats.busy_s += time.perf_counter() - t0
    for work, _ in pending:
        work.wait()
    return results if last else None
