"""Sampling parameters and the batched sampler the engine calls on last-position logits.

`sample(logits, params, generators)` is exact and deterministic: temperature 0 is argmax (ties
go to the lowest id, as torch.argmax does); otherwise temperature scaling, then top-k, top-p and
min-p filtering, then one draw per row. A row with a seed draws from its own torch.Generator, so
a seeded request gives the same tokens whatever else is in the batch. Use `step_generator(seed,
step)` for that generator: it depends only on the seed and the output position, so the token
the prefill instance samples (step 0) and the ones decode samples (step 1, 2, ...) are the same
as in a single-process run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # torch is imported where it is used: the router validates params without it
    import torch


class SamplingError(ValueError):
    """An invalid sampling parameter; `param` names it (the API maps this to HTTP 400)."""

    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(message)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Detokenization only (the router applies them): hide special tokens; keep a matched stop
    # string in the text.
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # Structured output (server/grammar.py): llguidance grammar text the tokens must follow, from
    # the token after `grammar_after` when that is set (e.g. `</think>`). None: unconstrained.
    grammar: str | None = None
    grammar_after: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def num(name: str, v: Any) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise SamplingError(name, f"{name} must be a number, got {v!r}")
            return float(v)

        def integer(name: str, v: Any) -> int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise SamplingError(name, f"{name} must be an integer, got {v!r}")
            return v

        self.temperature = num("temperature", self.temperature)
        if self.temperature < 0 or self.temperature == float("inf"):
            raise SamplingError("temperature", f"temperature must be >= 0 and finite, got {self.temperature}")
        self.top_p = num("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise SamplingError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = integer("top_k", self.top_k)
        if self.top_k == 0 or self.top_k < -1:
            raise SamplingError("top_k", f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        self.min_p = num("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise SamplingError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            integer("seed", self.seed)
            if not -(2**63) <= self.seed < 2**64:
                raise SamplingError("seed", f"seed must fit in 64 bits, got {self.seed}")
        integer("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 0:
            raise SamplingError("max_new_tokens", f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise SamplingError("stop", "stop must be a list of strings")
        if any(s == "" for s in self.stop):
            raise SamplingError("stop", "stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise SamplingError("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise SamplingError("grammar", "grammar must be a string")
        if self.grammar_after is not None and (isinstance(self.grammar_after, bool)
                                               or not isinstance(self.grammar_after, int) or self.grammar_after < 0):
            raise SamplingError("grammar_after", "grammar_after must be a token id")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(name, f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def step_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator for output position `step` of a request seeded with `seed`."""
    import torch

    g = torch.Generator(device=device)
    # Mix seed and step into one 64-bit value (splitmix64-style constants) so that nearby seeds
    # and steps do not produce correlated streams.
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % (1 << 64)
    g.manual_seed(x)
    return g


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> token ids [B] (int64). `generators[i]` (or None) is
    used for row i's draw; rows without one draw from torch's global generator. `allowed`
    (bool [B, V], structured output) masks out the tokens a row may not take."""
    import torch

    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [B, V] with B = len(params) = {len(params)}, got {tuple(logits.shape)}")
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        out[idx] = logits[idx].argmax(dim=-1)
    rest = [i for i, p in enumerate(params) if not p.greedy]
    if not rest:
        return out

    idx = torch.tensor(rest, device=logits.device)
    x = logits[idx].float()
    temps = torch.tensor([params[i].temperature for i in rest], device=x.device).unsqueeze(1)
    x = x / temps
    x = filter_logits(x, [params[i] for i in rest])
    probs = torch.softmax(x, dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is an exact draw from p, and lets each row
    # take its noise from its own generator.
    noise = torch.empty_like(probs).exponential_()  # unseeded rows: one draw for all
    for r, i in enumerate(rest):
        g = generators[i] if generators is not None else None
        if g is not None:
            noise[r].exponential_(generator=g)
    out[idx] = (probs / noise).argmax(dim=-1)
    return out


def filter_logits(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the logits that top-k, top-p or min-p exclude; x is temperature-scaled."""
    import torch

    V = x.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=x.device).clamp(max=V)
    top_p = torch.tensor([p.top_p for p in params], device=x.device)
    min_p = torch.tensor([p.min_p for p in params], device=x.device)
    need_sort = bool((top_k < V).any() or (top_p < 1).any())
    if need_sort:
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=x.device).unsqueeze(0)
        drop = rank >= top_k.unsqueeze(1)
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass
        # strictly before it already reaches top_p. The top token is always kept.
        before = probs.cumsum(dim=-1) - probs
        drop = drop | ((before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1))
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        x = x.masked_fill(probs < thresh, float("-inf"))
    return x
