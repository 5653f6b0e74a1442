"""Logprobs in each API's response shape, from the ids, logprobs and top [id, logprob] pairs the
instances computed (server/engine/logprobs.py: log_softmax of the raw logits).

- OpenAI chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
- OpenAI completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`;
  with `echo`, the prompt's tokens come first (the first has no logprob: null). Each position's
  `top_logprobs` holds the N most likely tokens and always the position's own token (as OpenAI
  and vLLM: N + 1 entries when it is not among them; with `logprobs: 0`, just that token).
- SGLang meta_info: `[logprob, token_id, text or null]` per token, and per position a list of
  such triples for the top logprobs.

A token's text is its own decoding (special tokens included), as vLLM and SGLang report it.
"""

from __future__ import annotations

from typing import Any, Sequence

from glm53.server.tokenizer import Tokenizer


def _finite(v: float | None) -> float | None:
    # JSON has no -inf: a token the model rules out gets a very small finite number (as SGLang does).
    return None if v is None else max(v, -9999.0)


class Texts:
    """Token texts, decoded once each per response."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False):
        # vLLM's return_tokens_as_token_ids form, "token_id:N": asked for, or no tokenizer.
        self.tok, self._cache, self.as_ids = tokenizer, {}, as_ids or not tokenizer.has_text

    def __call__(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = (f"token_id:{tid}" if self.as_ids
                                    else self.tok.decode([tid], skip_special_tokens=False))
        return s


def chat_content(texts: Texts, ids: Sequence[int], lps: Sequence[float], tops: Sequence[list]) -> list[dict]:
    """OpenAI chat `logprobs.content` entries for ids (tops[i]: [[id, logprob], ...])."""
    out = []
    for i, tid in enumerate(ids):
        s = texts(tid)
        out.append({"token": s, "logprob": _finite(lps[i]), "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [{"token": texts(t), "logprob": _finite(v), "bytes": list(texts(t).encode("utf-8"))}
                                     for t, v in (tops[i] if i < len(tops) else [])]})
    return out


def completion_logprobs(texts: Texts, ids: Sequence[int], lps: Sequence[float | None], tops: Sequence[list | None],
                        offset: int = 0) -> dict[str, Any]:
    """OpenAI completions `logprobs` for ids whose text starts at character `offset`."""
    tokens, offsets, top = [], [], []
    for i, tid in enumerate(ids):
        s = texts(tid)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        t = tops[i] if i < len(tops) else None
        if t is None:
            top.append(None)
            continue
        d = {texts(a): _finite(v) for a, v in t}
        if i < len(lps) and lps[i] is not None and s not in d:
            d[s] = _finite(lps[i])  # the sampled (or prompt) token, also when not among the top N
        top.append(d)
    return {"tokens": tokens, "token_logprobs": [_finite(v) for v in lps], "top_logprobs": top,
            "text_offset": offsets}


def merge_completion(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def sglang_tokens(texts: Texts | None, ids: Sequence[int], lps: Sequence[float | None]) -> list[list]:
    """SGLang `*_token_logprobs`: [logprob, id, text or None] per token."""
    return [[_finite(v), tid, texts(tid) if texts else None] for v, tid in zip(lps, ids)]


def sglang_tops(texts: Texts | None, tops: Sequence[list | None]) -> list[list | None]:
    """SGLang `*_top_logprobs`: per position, [logprob, id, text or None] per top token (None
    where a position has none, e.g. the prompt's first)."""
    return [None if not t else [[_finite(v), a, texts(a) if texts else None] for a, v in t] for t in tops]
