"""A request on a decode instance: what it has generated, streamed and still holds (pages, its
room's receivers, its grammar and stop-string state), and the prompt pages its choices share. The
decode scheduler (engine/decode.py) is the one that changes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from glm53.server.engine.scheduler import TrackedRequest
from glm53.server.engine.stops import StopText
from glm53.server.sampling import TokenHistory
from glm53.transport import RoomTransfer


@dataclass
class SharedPages:
    """The prompt's full pages of an n > 1 request: held once for all its choices (every choice's
    page table starts with them) and freed when the last choice is released."""

    pages: list[int]
    users: int


@dataclass
class DecodeRequest(TrackedRequest):
    receiver: RoomTransfer | None = None  # the room's receivers on every rank
    output: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)  # generated, not yet streamed
    aborted: bool = False  # while receiving: the pages wait for the receivers to be terminal
    ctx_start: int = 0  # first position whose draft context KV exists (the prompt's came from prefill)
    accepts: list[int] = field(default_factory=list)  # tokens committed per verify, not yet reported
    transfer_started: float = 0.0  # receivers created
    bootstrapped: float = 0.0  # receivers left BOOTSTRAPPING: prefill reached, destination sent
    constraint: Any = None  # structured output: the grammar state (engine/constraints.py)
    stops: StopText | None = None  # its stop strings' matcher (engine/stops.py); None: it has none
    index: int = 0  # the choice (0..n-1) of a request with n choices
    pending: int = 0  # overlapped steps launched for it and not read back (engine/overlap.py)
    finished: bool = False  # released: no more tokens are committed
    free_after_step: bool = False  # released while an in-flight step still writes its pages
    shared: SharedPages | None = None  # n > 1: the prompt's full pages, the head of `pages`
    unsent_lp: list[float] = field(default_factory=list)  # logprobs of `unsent` (if asked for)
    unsent_top: list[list] = field(default_factory=list)
    spec_key: int = -1  # names it to the draft across steps (the MTP draft keeps its verify's hidden rows)
    seed_hidden: torch.Tensor | None = None  # NEXTN: the prompt's last hidden row from prefill (its first step)

    _prompt_ids: torch.Tensor | None = None  # the prompt's distinct ids (repetition penalty), built once
    _stop_ids: list[int] | None = None
    _stop_set: frozenset[int] | None = None  # RequestSpec.stop_ids, built once (it builds two sets a call)

    @property
    def stop_set(self) -> frozenset[int]:
        """The ids whose commit ends the request (stop tokens, eos unless ignored)."""
        if self._stop_set is None:
            self._stop_set = self.req.spec.stop_ids
        return self._stop_set

    def history(self, device: torch.device) -> TokenHistory | None:
        """What penalties, logit_bias and min_new_tokens need (None when the request has none)."""
        if not self.params.adjusts:
            return None
        if self._prompt_ids is None or self._prompt_ids.device != device:
            self._prompt_ids = torch.tensor(sorted(set(self.req.spec.input_ids)), dtype=torch.long, device=device)
            self._stop_ids = sorted(self.req.spec.stop_ids)
        return TokenHistory(self._prompt_ids, self.output, self._stop_ids)
