"""Sampling parameters and the batched sampler the engine calls on last-position logits.

`sample(logits, params, generators)` is exact and deterministic: temperature 0 is argmax (ties
go to the lowest id, as torch.argmax does); otherwise temperature scaling, then top-k, top-p and
min-p filtering, then one draw per row. A row with a seed draws from its own torch.Generator, so
a seeded request gives the same tokens whatever else is in the batch. Use `step_generator(seed,
step)` for that generator: it depends only on the seed and the output position, so the token
the prefill instance samples (step 0) and the ones decode samples (step 1, 2, ...) are the same
as in a single-process run. A request with n > 1 choices draws choice i's randomness from
`step_generator(seed, step, choice=i)` (choice 0 is the n = 1 stream).

Before temperature, `adjust_logits` applies what depends on the request's tokens so far, on
batched [B, V] tensors: `logit_bias` (added), `min_new_tokens` (the stop ids masked until that
many tokens exist), then the repetition penalty over prompt and output tokens (positive logits
divided, negative multiplied, as vLLM and SGLang do) and the frequency and presence penalties
over output tokens (OpenAI's definition: logit -= frequency * count + presence * (count > 0)).
Logprobs (`token_logprobs`) are always of the model's raw logits, before any of this.
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
    # None only on the router before the prompt is known: "the rest of the context"
    # (router/intake.request_spec resolves it; instances always receive a number).
    max_new_tokens: int | None = 128
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
    # Token-history dependent adjustments (adjust_logits); defaults leave the logits as they are.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_new_tokens: int = 0

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
        if self.max_new_tokens is not None and integer("max_new_tokens", self.max_new_tokens) < 0:
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = num(name, getattr(self, name))
            if not -2 <= v <= 2:
                raise SamplingError(name, f"{name} must be in [-2, 2], got {v}")
            setattr(self, name, v)
        self.repetition_penalty = num("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 2:
            raise SamplingError("repetition_penalty",
                                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if not isinstance(self.logit_bias, dict):
            raise SamplingError("logit_bias", "logit_bias must map token ids to numbers")
        bias = {}
        for k, v in self.logit_bias.items():
            try:
                tok = int(k)  # JSON object keys arrive as strings
            except (TypeError, ValueError):
                raise SamplingError("logit_bias", f"logit_bias: key {k!r} is not a token id") from None
            if tok < 0:
                raise SamplingError("logit_bias", f"logit_bias: token id {tok} is negative")
            b = num("logit_bias", v)
            if not -100 <= b <= 100:
                raise SamplingError("logit_bias", f"logit_bias values must be in [-100, 100], got {b}")
            bias[tok] = b
        self.logit_bias = bias
        integer("min_new_tokens", self.min_new_tokens)
        if self.min_new_tokens < 0:
            raise SamplingError("min_new_tokens", f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingError(name, f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts(self) -> bool:
        """Whether `adjust_logits` changes this request's logits (it needs the token history)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_new_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class TokenHistory:
    """What `adjust_logits` needs of one row: the prompt ids (repetition penalty; a sequence, or
    a tensor of its distinct ids), the tokens generated before this position, and the ids that
    end the request (masked by min_new_tokens)."""

    prompt: Sequence[int] | torch.Tensor
    output: Sequence[int]
    stop_ids: Sequence[int] = ()


def step_generator(seed: int, step: int, device: torch.device | str = "cpu", choice: int = 0) -> torch.Generator:
    """The generator for output position `step` of choice `choice` of a request seeded with `seed`."""
    import torch

    g = torch.Generator(device=device)
    # Mix seed, step and choice into one 64-bit value (splitmix64-style constants) so that nearby
    # seeds and steps do not produce correlated streams.
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + choice * 0xD6E8FEB86659FD93
         + 0x94D049BB133111EB) % (1 << 64)
    g.manual_seed(x)
    return g


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  histories: Sequence[TokenHistory | None] | None) -> torch.Tensor:
    """logits [B, V] with logit_bias, min_new_tokens and the penalties applied (float32 for the
    rows that change); the same tensor when no row asks for any of them."""
    import torch

    rows = [i for i, p in enumerate(params) if p.adjusts]
    if not rows:
        return logits
    if histories is None or any(histories[i] is None for i in rows):
        raise ValueError("penalties, logit_bias and min_new_tokens need each row's TokenHistory")
    dev, V = logits.device, logits.shape[1]
    out = logits.float().clone()
    idx = torch.tensor(rows, device=dev)
    x = out[idx]
    R = len(rows)
    ps = [params[i] for i in rows]
    hs = [histories[i] for i in rows]

    def pairs(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, token id) for every id of every row's list (ids outside the vocab dropped)."""
        r = [k for k, ids in enumerate(lists) for t in ids if 0 <= t < V]
        t = [t for ids in lists for t in ids if 0 <= t < V]
        return torch.tensor(r, dtype=torch.long, device=dev), torch.tensor(t, dtype=torch.long, device=dev)

    bias_rows = [k for k, p in enumerate(ps) if p.logit_bias]
    if bias_rows:
        r, t = pairs([list(p.logit_bias) if p.logit_bias else [] for p in ps])
        vals = torch.tensor([b for p in ps for tok, b in p.logit_bias.items() if 0 <= tok < V], device=dev)
        x.index_put_((r, t), vals, accumulate=True)
    masked = [list(h.stop_ids) if len(h.output) < p.min_new_tokens else [] for p, h in zip(ps, hs)]
    if any(masked):
        r, t = pairs(masked)
        x[r, t] = float("-inf")
    # Which adjustments run is decided from the params on the host: no device sync.
    if any(p.repetition_penalty != 1 for p in ps):
        rep = torch.tensor([p.repetition_penalty for p in ps], device=dev).unsqueeze(1)
        seen = torch.zeros(R, V, dtype=torch.bool, device=dev)
        r, t = pairs([list(h.output) if p.repetition_penalty != 1 else [] for p, h in zip(ps, hs)])
        seen[r, t] = True
        for k, (p, h) in enumerate(zip(ps, hs)):
            if p.repetition_penalty != 1:
                # A long prompt comes as a cached tensor of its distinct ids (decode builds it once);
                # prompt ids were checked against the vocabulary when the request was accepted.
                prompt = (h.prompt if isinstance(h.prompt, torch.Tensor)
                          else torch.tensor(list(h.prompt), dtype=torch.long))
                seen[k].index_fill_(0, prompt.to(dev), True)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if any(p.frequency_penalty or p.presence_penalty for p in ps):
        freq = torch.tensor([p.frequency_penalty for p in ps], device=dev).unsqueeze(1)
        pres = torch.tensor([p.presence_penalty for p in ps], device=dev).unsqueeze(1)
        counts = torch.zeros(R, V, device=dev)
        r, t = pairs([list(h.output) for h in hs])
        counts.index_put_((r, t), torch.ones(len(t), device=dev), accumulate=True)
        x = x - freq * counts - pres * (counts > 0).float()
    out[idx] = x
    return out


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int],
                   top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The logprob of each row's token under log_softmax of the raw logits [R, V], and (top > 0)
    each row's `top` most likely (id, logprob) pairs, most likely first."""
    import torch

    ls = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=ls.device).view(-1, 1)
    from glm53.models.readback import readback

    lp = readback(ls.gather(1, ids).squeeze(1)).tolist()
    if top <= 0:
        return lp, [[] for _ in lp]
    vals, tok = ls.topk(min(top, ls.shape[1]), dim=-1)
    return lp, [list(zip(t, v)) for t, v in zip(readback(tok).tolist(), readback(vals).tolist())]


def on_device(values: list, device: torch.device, dtype=None) -> torch.Tensor:
    """A small host list as a device tensor through a pinned non-blocking copy: a plain
    `torch.tensor(..., device=cuda)` waits for every kernel queued before it (a host sync)."""
    import torch

    t = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    histories: Sequence[TokenHistory | None] | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> token ids [B] (int64). `generators[i]` (or None) is
    used for row i's draw; rows without one draw from torch's global generator. `histories[i]`
    is row i's token history, needed by rows whose params adjust the logits (penalties,
    logit_bias, min_new_tokens). `allowed` (bool [B, V], structured output) masks out the
    tokens a row may not take, after those adjustments."""
    import torch

    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(f"logits must be [B, V] with B = len(params) = {len(params)}, got {tuple(logits.shape)}")
    if allowed is None and all(p.greedy and not p.adjusts for p in params):
        return logits.argmax(dim=-1)  # the common all-greedy batch: one kernel, no index tensors
    logits = adjust_logits(logits, params, histories)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device, non_blocking=True), float("-inf"))
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        idx = on_device(greedy, logits.device)
        out[idx] = logits[idx].argmax(dim=-1)
    rest = [i for i, p in enumerate(params) if not p.greedy]
    if not rest:
        return out

    idx = on_device(rest, logits.device)
    x = logits[idx].float()
    temps = on_device([params[i].temperature for i in rest], x.device).unsqueeze(1)
    x = x / temps
    x = filter_logits(x, [params[i] for i in rest])
    probs = torch.softmax(x, dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) is an exact draw from p, and lets each row
    # take its noise from its own generator.
    noise = torch.empty_like(probs).exponential_()  # unseeded rows: one draw for all
    for r, i in enumerate(rest):
        g = generators[i] if generators is not None else None
        if g is not None:
            # Drawn where the generator lives (the CPU for step_generator's), then copied: a
            # seeded request gets the same noise on any device.
            row = torch.empty(probs.shape[-1], dtype=probs.dtype, device=g.device).exponential_(generator=g)
            noise[r] = row.to(noise.device, non_blocking=True)
    out[idx] = (probs / noise).argmax(dim=-1)
    return out


def filter_logits(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) the logits that top-k, top-p or min-p exclude; x is temperature-scaled.
    (kernels/sampling_filter.py, which the draft's own distribution uses too.)"""
    from glm53.kernels.sampling_filter import filter_logits as filter_rows

    V = x.shape[-1]
    # Which filters run is decided from the params on the host: nothing here waits for the GPU.
    sort = any(0 < p.top_k < V or p.top_p < 1 for p in params)
    use_min_p = any(p.min_p > 0 for p in params)
    if not (sort or use_min_p):
        return x
    top_k = on_device([min(p.top_k, V) if p.top_k > 0 else V for p in params], x.device)
    top_p = on_device([p.top_p for p in params], x.device)
    min_p = on_device([p.min_p for p in params], x.device)
    return filter_rows(x, top_k, top_p, min_p, sort=sort, use_min_p=use_min_p)
