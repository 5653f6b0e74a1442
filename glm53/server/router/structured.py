"""Structured output in the HTTP API: the request field that asks for it, to the grammar text both
instances enforce (server/grammar.py).

- OpenAI (`/v1/chat/completions`, `/v1/completions`): `response_format` `{"type": "json_schema",
  "json_schema": {"schema": {...}}}` or `{"type": "json_object"}` (`"text"`: none).
- SGLang `/generate`: `sampling_params.json_schema` (JSON text), `regex` or `ebnf` (GBNF or
  Lark), at most one of them.

Grammars are compiled here (in a worker thread, against the model's tokenizer, cached) so that a
bad one is a 400 naming the field before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from glm53.server.grammar import GrammarError, Grammars, grammar_for
from glm53.server.router.generation import RouterState
from glm53.server.router.schemas import APIError
from glm53.server.tokenizer import NoTokenizer


@dataclass
class Ask:
    """What a request asked for: a constraint kind (grammar.KINDS), its value and the field."""

    kind: str
    value: Any
    param: str


def from_response_format(fmt: Any, param: str = "response_format") -> Ask | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, f"{param} must be an object", param)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Ask("json_object", None, param)
    if kind == "json_schema":
        js = fmt.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if schema is None:
            raise APIError(400, f"{param}.json_schema.schema is required for type json_schema",
                           f"{param}.json_schema")
        return Ask("json_schema", schema, f"{param}.json_schema")
    raise APIError(400, f"{param}.type must be text, json_object or json_schema; got {kind!r}", f"{param}.type")


def from_sampling_params(sp: Any) -> Ask | None:
    """SGLang's json_schema / regex / ebnf (`sampling_params.<key>`)."""
    asks = [Ask(k, getattr(sp, k), f"sampling_params.{k}") for k in ("json_schema", "regex", "ebnf")
            if getattr(sp, k) is not None]
    if len(asks) > 1:
        raise APIError(400, f"at most one of json_schema, regex and ebnf may be given; got "
                       f"{' and '.join(a.kind for a in asks)}", asks[1].param)
    return asks[0] if asks else None


def compile_grammar(state: RouterState, ask: Ask) -> str:
    """The grammar text for `ask`, compiled once against the tokenizer (worker thread)."""
    if not state.tokenizer.has_text:
        raise APIError(400, str(NoTokenizer("structured output")), ask.param)
    try:
        grammar = grammar_for(ask.kind, ask.value, ask.param)
        if state.grammars is None:
            t = state.tokenizer
            state.grammars = Grammars(t.tok.to_str(), t.vocab_size, t.eos_token_ids)
        state.grammars.check(grammar, ask.param)
    except GrammarError as e:
        raise APIError(400, str(e), e.param) from None
    return grammar


async def grammar(state: RouterState, ask: Ask | None) -> str | None:
    return None if ask is None else await state.offload.run(compile_grammar, state, ask)
