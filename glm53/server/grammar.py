"""Structured output: grammars that decide which tokens may come next (llguidance).

- `grammar_for(kind, value, param)` (router): a request's `json_schema`, `json_object`, `regex`,
  `ebnf` (GBNF, as SGLang/xgrammar take it, or Lark) or `lark` as llguidance's grammar text;
  `Grammars.check` compiles it against the model's tokenizer. Both raise `GrammarError` naming
  the field the client sent (HTTP 400). The grammar text travels to both instances in
  `SamplingParams.grammar`.
- `Grammars` (one per process and model): the llguidance tokenizer, built once, and a cache of
  compiled grammars; `matcher(grammar)` is a copy of the cached, compiled one.
- `Constraint` (one per request on an instance): the allowed-token mask for the next position,
  advancing over committed tokens, and the masks for every position of a speculative block
  (advanced over the drafts, then rolled back). With `start_after` (a token id, e.g. `</think>`)
  the constraint holds only after that token was generated, so a model may think first.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KINDS = ("json_schema", "json_object", "regex", "ebnf", "lark")
# JSON without free whitespace (", " and ": " separators): a model cannot stall in an endless
# run of blanks, and every output is one compact document. A schema may override this through
# llguidance's "x-guidance" key.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept per process


class GrammarError(ValueError):
    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(message)


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llguidance") is not None


def grammar_for(kind: str, value: Any, param: str) -> str:
    """llguidance's grammar text for a constraint of `kind` (KINDS)."""
    if not available():
        raise GrammarError(param, "structured output needs the llguidance package, which is not installed here")
    from llguidance import LLMatcher, grammar_from

    try:
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json_schema":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        if not isinstance(value, str) or not value:
            raise ValueError(f"{kind} must be a non-empty string")
        if kind == "regex":
            return LLMatcher.grammar_from_regex(value)
        if kind == "ebnf":
            return grammar_from("ebnf", value)
        if kind == "lark":
            return LLMatcher.grammar_from_lark(value)
    except (ValueError, TypeError, RuntimeError) as e:
        raise GrammarError(param, f"{param}: not a valid {kind.replace('_', ' ')}: {e}") from None
    raise GrammarError(param, f"unknown constraint kind {kind!r}")


class Grammars:
    """The llguidance tokenizer of one model and its compiled grammars (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        from llguidance import LLTokenizer

        self.vocab_size = vocab_size
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Grammars":
        from glm53.server.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(model_dir)
        return cls(tok.tok.to_str(), tok.vocab_size, tok.eos_token_ids)

    def _compiled(self, grammar: str) -> Any:
        from llguidance import LLMatcher

        with self._lock:
            m = self._cache.get(grammar)
            if m is not None:
                self._cache.move_to_end(grammar)
                return m
        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError("grammar", m.get_error())
        with self._lock:
            self._cache[grammar] = m
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return m

    def check(self, grammar: str, param: str) -> None:
        """Compile (and cache) `grammar`; GrammarError naming `param` if it does not compile."""
        try:
            self._compiled(grammar)
        except GrammarError as e:
            raise GrammarError(param, f"{param}: {e}") from None

    def matcher(self, grammar: str) -> Any:
        return self._compiled(grammar).deep_copy()


def unpack_bitmask(bits: bytes, vocab_size: int) -> "torch.Tensor":
    """llguidance's mask (bit t of the little-endian words = token t) as bool [vocab_size]."""
    import torch

    b = torch.frombuffer(bytearray(bits), dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b.unsqueeze(1) >> shifts) & 1).bool().reshape(-1)[:vocab_size]


class Constraint:
    """One request's grammar state on an instance."""

    def __init__(self, matcher: Any, vocab_size: int, start_after: int | None = None):
        self.m, self.vocab_size = matcher, vocab_size
        self.waiting_for = start_after  # the token after which the grammar holds; None: it holds now

    def allowed(self) -> "torch.Tensor | None":
        """Bool [vocab] of the tokens allowed next (None: unconstrained here). A matcher in an
        error state allows nothing but what llguidance's mask says (eos)."""
        if self.waiting_for is not None:
            return None
        return unpack_bitmask(self.m.compute_bitmask(), self.vocab_size)

    def _take(self, tok: int) -> int:
        """Advance over one token; how many tokens the matcher consumed (0 or 1), or -1 when
        the grammar does not allow it."""
        if self.waiting_for is not None:
            if tok == self.waiting_for:
                self.waiting_for = None
            return 0
        if self.m.is_stopped():
            return 0  # only eos can follow a finished grammar
        # try_consume_tokens refuses a token without putting the matcher in its (permanent)
        # error state, as consume_token would: a refused draft must leave it usable.
        return 1 if self.m.try_consume_tokens([int(tok)]) == 1 else -1

    def advance(self, tokens: list[int]) -> None:
        for t in tokens:
            self._take(t)

    def block_masks(self, drafts: list[int]) -> "list[torch.Tensor | None]":
        """The masks of a verify block's len(drafts) + 1 positions: position i's, given the
        drafts before it. The matcher ends where it began. Past a draft the grammar refuses,
        the positions repeat the last mask: such a draft is never accepted (its probability
        under the mask is 0), so those positions are never used."""
        waiting, consumed, masks = self.waiting_for, 0, []
        for i in range(len(drafts) + 1):
            masks.append(self.allowed())
            if i == len(drafts):
                break
            took = self._take(drafts[i])
            if took < 0:
                masks.extend([masks[-1]] * (len(drafts) - i))
                break
            consumed += took
        if consumed:
            self.m.rollback(consumed)
        self.waiting_for = waiting
        return masks
