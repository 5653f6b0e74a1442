"""The MTP draft's seed in the KV commit record (`MetadataRow`).

With NEXTN and the draft KV sent, prefill's last stage puts the target's final-normed hidden row
at the prompt's last position (what the lm_head read for the first token) into the metadata
row, in the instance dtype: `counts[2]` its byte length, `counts[3]` its dtype's code, and the
bytes at the head of the payload (the first token's logprobs, if any, follow). Decode hands it
to the draft with the request's first step (`DraftBlock.seed_hidden`), so that step already
drafts. The metadata slot is sized for it (`seed_bytes`, worker.RankWorker.allocate).
"""

from __future__ import annotations

import torch

_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_DTYPES = {v: k for k, v in _CODES.items()}


def seed_bytes(hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes one seed row takes in the payload."""
    return hidden_size * torch.empty((), dtype=dtype).element_size()


def pack_seed(hidden: torch.Tensor) -> tuple[bytes, int]:
    """A hidden row [H] as (bytes, dtype code)."""
    h = hidden.detach().reshape(-1).to("cpu").contiguous()
    return h.view(torch.uint8).numpy().tobytes(), _CODES[h.dtype]


def split_payload(counts, payload: bytes) -> tuple[torch.Tensor | None, bytes]:
    """(the seed row [H] on the host, or None; the rest of the payload)."""
    n = counts[2] if len(counts) > 3 else 0
    if n <= 0 or counts[3] not in _DTYPES or n > len(payload):
        return None, payload
    seed = torch.frombuffer(bytearray(payload[:n]), dtype=torch.uint8).view(_DTYPES[counts[3]])
    return seed, payload[n:]
