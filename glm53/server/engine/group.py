"""The rank workers of one instance, as the scheduler sees them.

`WorkerGroup` is the whole interface between an instance's scheduler and its `tp × pp` ranks:
run a batch, open a room's KV transfer on every rank, report capacity, close. Its results are
already combined over ranks: a forward returns the last stage's logits once, and a room's
transfer is one `RoomTransfer` that reaches a terminal state only when every rank's handle did
(the "all ranks done" rule that guards freeing pages). `LocalWorkers` runs the single rank of a
tp = pp = 1 instance inside the scheduler's process; rank processes under `torch.distributed`
implement the same interface.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from glm53.models import GlmConfig, SeqChunk
from glm53.models.draft import DraftBlock
from glm53.models.runner import DeviceTokens
from glm53.models.spec_state import SpecOutput
from glm53.server.engine.worker import RankSpec, RankWorker
from glm53.transport import Room, RoomTransfer


class WorkerGroup(abc.ABC):
    cfg: GlmConfig
    num_pages: int  # KV pages every rank holds (one page-id space for the whole instance)
    page_size: int
    bytes_per_page: int  # KV bytes one page costs, summed over every pool of every rank
    draft_bytes_per_page: int  # of those, the draft's pools' (moved only with draft_kv_transfer)
    block_size: int | None  # the DFlash draft's block size; None without a draft
    sends_draft_kv: bool  # prefill: the transfers carry the prompt's draft context KV

    pp: int = 1  # pipeline stages
    # Whether `forward_decode` exists: a decode step whose inputs are the previous step's samples
    # still on the device (the overlapped decode loop, engine/decode.py).
    device_tokens: bool = False

    @abc.abstractmethod
    def forward_microbatches(self, microbatches: list[list[SeqChunk]]) -> list[list[torch.Tensor]]:
        """Run a step's micro-batches, in order, through every stage (pipelined across stages:
        a request's consecutive chunks may sit in consecutive micro-batches); per micro-batch,
        per chunk, the last stage's logits [rows, vocab] (fp32), identical for all ranks."""

    def forward(self, chunks: list[SeqChunk]) -> list[torch.Tensor]:
        """One micro-batch."""
        return self.forward_microbatches([chunks])[0]

    @abc.abstractmethod
    def spec_step(self, blocks: list[DraftBlock]) -> SpecOutput:
        """Decode with a draft: propose, then verify in one target forward (ModelRunner.spec_step);
        the drafts, the verify logits and (when computed) their argmaxes per request."""

    @property
    def spec_overlap(self) -> bool:
        """Whether `spec_launch` and `spec_relaunch` exist (the overlapped speculative loop)."""
        return False

    def spec_launch(self, blocks: list[DraftBlock]) -> torch.Tensor | None:
        """A speculative step launched without waiting (greedy acceptance assumed for the next
        one): its tokens [len(blocks), 2K] on the device, or None when it must run as
        `spec_step` (ModelRunner.spec_launch; a group without `spec_overlap`: always None)."""
        return None

    def spec_relaunch(self, m: int, reach: int) -> torch.Tensor | None:
        """The step after the last launch, its inputs from the device (ModelRunner.spec_relaunch);
        None: launch from the host's rows instead."""
        return None

    @abc.abstractmethod
    def create_senders(self, room: Room, decode_instance: str) -> RoomTransfer:
        """Prefill: one sender per rank for `room`, combined."""

    @abc.abstractmethod
    def create_receivers(self, room: Room, bootstrap_address: str, dst_pages: list[int]) -> RoomTransfer:
        """Decode: one receiver per rank for `room`, writing into `dst_pages`, combined."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def sync(self) -> None:
        """Once per scheduler step: deliver queued transfer operations to every rank and refresh
        their transfer states (ranks in other processes only)."""

    @abc.abstractmethod
    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages src[i] -> dst[i] in every KV pool of every rank, before the next forward
        (decode: the prompt's KV for each further choice of an n > 1 request)."""

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class LocalWorkers(WorkerGroup):
    """The one rank of a tp = pp = 1 instance, in the scheduler's process."""

    def __init__(self, specs: Sequence[RankSpec], weights_from: "LocalWorkers | None" = None):
        """`weights_from`: another instance's rank in this process whose weights this one shares
        where they are the same (a colocated pair, engine/colocate.py)."""
        if len(specs) != 1:
            raise ValueError(f"LocalWorkers runs exactly one rank, got {len(specs)}")
        self.rank = RankWorker(specs[0], weights_from=weights_from.rank if weights_from is not None else None)
        self.num_pages = self.rank.capacity()
        self.rank.allocate(self.num_pages)
        self.cfg = self.rank.cfg
        self.page_size = specs[0].page_size
        self.bytes_per_page = self.rank.bytes_per_page
        self.draft_bytes_per_page = self.rank.draft_bytes_per_page
        self.block_size = self.rank.block_size
        self.sends_draft_kv = self.rank.sends_draft_kv

    device_tokens = True

    def forward_microbatches(self, microbatches: list[list[SeqChunk]]) -> list[list[torch.Tensor]]:
        return self.rank.forward_microbatches(microbatches)

    def forward_decode(self, chunks: list[SeqChunk], tokens: DeviceTokens | None) -> torch.Tensor:
        """A decode batch (one token per chunk) whose inputs `tokens` names are on the device:
        its logits [len(chunks), vocab], returned without waiting for the GPU. They may be a
        decode graph's output (`ModelRunner.decode_rows`): sample them before the next step."""
        return self.rank.decode_rows(chunks, tokens)

    def spec_step(self, blocks: list[DraftBlock]) -> SpecOutput:
        return self.rank.spec_step(blocks)

    @property
    def spec_overlap(self) -> bool:
        return self.rank.runner.spec_overlap

    def spec_launch(self, blocks: list[DraftBlock]) -> torch.Tensor | None:
        return self.rank.spec_launch(blocks)

    def spec_relaunch(self, m: int, reach: int) -> torch.Tensor | None:
        return self.rank.spec_relaunch(m, reach)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.rank.copy_pages(src, dst)

    def create_senders(self, room: Room, decode_instance: str) -> RoomTransfer:
        return RoomTransfer([self.rank.create_sender(room, decode_instance)])

    def create_receivers(self, room: Room, bootstrap_address: str, dst_pages: list[int]) -> RoomTransfer:
        return RoomTransfer([self.rank.create_receiver(room, bootstrap_address, dst_pages)])

    def close(self) -> None:
        self.rank.close()
