"""tool_choice "required" / a named function: the call grammar (router/parsers/tool_grammar.py)
constrains each call's arguments by the tool's parameter schema, so what the parser builds from
any text the grammar allows always validates. Random walks under the grammar, on the embedded
model's tokenizer, stand in for a model that writes anything it is allowed to."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from glm53.server.grammar import Constraint, Grammars, grammar_for
from glm53.server.router.parsers.chat import ChatParsing
from glm53.server.router.parsers.tool_calls import KEY_END, VAL_END, parse_tool_calls
from glm53.server.router.parsers.tool_grammar import looks_typed, tool_call_lark
from glm53.server.router.schemas import ChatCompletionRequest
from glm53.server.tokenizer import Tokenizer
from tests.e2e.structured_checks import validates

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "description": "a city"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["c", "f"]}, "temp": {"type": "number", "minimum": -50, "maximum": 60},
        "flag": {"type": "boolean"}, "maybe": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "code": {"type": "string", "pattern": "^[A-Z]{3}$"}, "short": {"type": "string", "maxLength": 4},
        "ref": {"$ref": "#/$defs/n"}, "mix": {"type": ["string", "integer"], "maxLength": 3},
        "opts": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                 "additionalProperties": False},
        "anything": {}},
        "required": ["city", "days", "code", "maybe"], "$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}},
    "get_time": {"type": "object", "properties": {}},
    "free": {},
}


@pytest.fixture(scope="module")
def grammars(model_dir) -> Grammars:
    return Grammars.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def walk(c: Constraint, tok: Tokenizer, gen: torch.Generator, limit: int = 400) -> list[int] | None:
    """Random tokens under the masks until eos; markers that end a key or value are taken often,
    so that free text ends (None if it ran past `limit`)."""
    ends = {tok.token_to_id(m) for m in (VAL_END, KEY_END)} | set(tok.eos_token_ids)
    out = []
    for _ in range(limit):
        allowed = c.allowed().nonzero().flatten().tolist()
        closing = [t for t in allowed if t in ends]
        if closing and torch.rand(1, generator=gen).item() < 0.3:
            t = closing[0]
        else:
            t = allowed[int(torch.randint(len(allowed), (1,), generator=gen))]
        if t in tok.eos_token_ids:
            return out
        out.append(t)
        c.advance([t])
    return None


def calls_of(grammars, tok, lark: str, seed: int, n: int) -> list[tuple[str, list]]:
    g = grammar_for("lark", lark, "tool_choice")
    grammars.check(g, "tool_choice")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = walk(Constraint(grammars.matcher(g), grammars.vocab_size), tok, gen)
        if ids is None:
            continue
        text = tok.decode(ids, skip_special_tokens=False)
        content, calls = parse_tool_calls(text, TOOLS)
        assert content == "" and calls and all(c.complete for c in calls), text
        out.append((text, calls))
    assert len(out) >= n // 2  # most walks end
    return out


def test_every_call_the_grammar_allows_validates(grammars, tok):
    lark = tool_call_lark(tok.token_to_id, TOOLS, None, True)
    seen: set[str] = set()
    for text, calls in calls_of(grammars, tok, lark, 0, 48):
        for c in calls:
            args = json.loads(c.arguments)
            assert validates(args, TOOLS[c.name] or {}), (c.name, args, text)
            if c.name == "get_weather":
                assert {"city", "days", "code", "maybe"} <= set(args), args
                seen |= set(args)
    # the optional keys and every kind of value were written at some point
    assert {"unit", "temp", "flag", "tags", "short", "ref", "mix", "opts", "anything"} <= seen, seen


def test_named_function_and_one_call(grammars, tok):
    lark = tool_call_lark(tok.token_to_id, TOOLS, "get_weather", True)
    for _, calls in calls_of(grammars, tok, lark, 1, 12):
        assert [c.name for c in calls] == ["get_weather"]
        assert validates(json.loads(calls[0].arguments), TOOLS["get_weather"])
    lark = tool_call_lark(tok.token_to_id, TOOLS, None, False)
    for _, calls in calls_of(grammars, tok, lark, 2, 12):
        assert len(calls) == 1


def test_raw_text_the_parser_would_type_is_kept_out_of_strings():
    # A mixed string/other value written as raw text must stay a string for the parser.
    for s in ("3", "-1", " x", "[1]", "{}", "(1,)", ".5", "true", "None", "null"):
        assert looks_typed(s), s
    for s in ("Paris", "tru", "nulls", "'a'", '"a"', "", "a b"):
        assert not looks_typed(s), s


def test_call_cut_off_stays_content():
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                 "tool_choice": "required"})
    p = ChatParsing.for_request(SimpleNamespace(reasoning_parser=None, tool_call_parser="glm47"), body, "")
    done = "<tool_call>get_time</tool_call>"
    cut = "<tool_call>get_weather<arg_key>days</arg_key><arg_value>1"
    msg, called = p.message(cut)
    assert msg["content"] == cut and msg["tool_calls"] == [] and not called
    msg, called = p.message(done + cut)  # the complete call stays a call
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"] and msg["content"] == cut and called
    assert p.message(done)[0]["content"] is None
