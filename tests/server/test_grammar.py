"""Structured output's grammar state (server/grammar.py, server/engine/constraints.py) and the
sampler's allowed-token hook, on the embedded model's tokenizer."""

from __future__ import annotations

import json
import re

import pytest
import torch

from glm53.server.engine.constraints import mask_block, masks
from glm53.server.grammar import Constraint, GrammarError, Grammars, grammar_for
from glm53.server.sampling import SamplingParams, sample
from glm53.server.tokenizer import Tokenizer

REGEX = r"(ab|cd){2,3}-[0-9]{3}"


@pytest.fixture(scope="module")
def grammars(model_dir) -> Grammars:
    return Grammars.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def walk(c: Constraint, tok: Tokenizer, gen: torch.Generator, limit: int = 64) -> list[int]:
    """Random tokens under the masks until eos."""
    out = []
    for _ in range(limit):
        allowed = c.allowed().nonzero().flatten()
        t = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        if t in tok.eos_token_ids:
            return out
        out.append(t)
        c.advance([t])
    raise AssertionError(f"no eos after {limit} tokens: {tok.decode(out)!r}")


def test_random_walks_follow_the_grammar(grammars, tok):
    gen = torch.Generator().manual_seed(0)
    g = grammar_for("regex", REGEX, "regex")
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 50},
                                               "b": {"enum": ["x", "y"]}}, "required": ["a", "b"],
              "additionalProperties": False}
    js = grammar_for("json_schema", json.dumps(schema), "json_schema")
    for _ in range(5):
        assert re.fullmatch(REGEX, tok.decode(walk(Constraint(grammars.matcher(g), grammars.vocab_size), tok, gen)))
        obj = json.loads(tok.decode(walk(Constraint(grammars.matcher(js), grammars.vocab_size), tok, gen)))
        assert set(obj) == {"a", "b"} and 0 <= obj["a"] <= 50 and obj["b"] in ("x", "y")


def test_block_masks_equal_step_by_step_and_roll_back(grammars, tok):
    g = grammar_for("regex", REGEX, "regex")
    good = tok.encode("abcd-1")
    bad = tok.encode("zz")[0]
    for drafts in (good, good[:2] + [bad] + good[2:], [bad] + good):
        c = Constraint(grammars.matcher(g), grammars.vocab_size)
        c.advance(good[:1])
        before = c.allowed()
        block = c.block_masks(drafts)
        assert torch.equal(c.allowed(), before)  # rolled back
        assert len(block) == len(drafts) + 1
        ref = Constraint(grammars.matcher(g), grammars.vocab_size)
        ref.advance(good[:1])
        for i, d in enumerate(drafts):
            assert torch.equal(block[i], ref.allowed()), i
            if not ref.allowed()[d]:
                break  # later positions are never used
            ref.advance([d])
        # logits masked per position; a refused draft has -inf there
        lg = torch.randn(len(drafts) + 1, grammars.vocab_size + 64)
        out = mask_block(c, drafts, lg)
        assert torch.isinf(out[:, grammars.vocab_size:]).all()
        for i in range(len(drafts) + 1):
            assert torch.equal(torch.isfinite(out[i, :grammars.vocab_size]), block[i])


def test_start_after_a_token(grammars, tok):
    g = grammar_for("regex", "[0-9]+", "regex")
    end = tok.token_to_id("</think>")
    c = Constraint(grammars.matcher(g), grammars.vocab_size, start_after=end)
    assert c.allowed() is None and masks([c, None], 100) is None
    c.advance(tok.encode("free text"))
    blk = c.block_masks([tok.encode("x")[0], end, tok.encode("7")[0]])
    assert blk[0] is None and blk[1] is None and blk[2] is not None and c.waiting_for == end
    c.advance([end])
    m = c.allowed()
    assert m is not None and m[tok.encode("7")[0]] and not m[tok.encode("x")[0]]


def test_sample_respects_allowed():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    allowed = torch.zeros(4, 50, dtype=torch.bool)
    allowed[0, [3, 7]] = True
    allowed[1, 11] = True
    allowed[2:, :] = True
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5, seed=2)]
    for _ in range(20):
        out = sample(logits, params, None, allowed=allowed).tolist()
        assert out[0] == (3 if logits[0, 3] > logits[0, 7] else 7) and out[1] == 11
        assert out[2] == int(logits[2].argmax())
    assert torch.equal(sample(logits, params[2:3] * 4), logits.argmax(-1))


def test_bad_grammars(grammars):
    for kind, value in (("regex", "[a-"), ("json_schema", '{"type": "nonsense"}'), ("ebnf", "root ::= ("),
                        ("lark", "start: @@")):
        with pytest.raises(GrammarError) as e:
            grammars.check(grammar_for(kind, value, kind), kind)
        assert e.value.param == kind
    with pytest.raises(GrammarError):
        grammar_for("json_schema", "{not json", "json_schema")
    with pytest.raises(GrammarError):
        grammar_for("json_schema", "[1, 2]", "json_schema")
    assert SamplingParams.from_dict(SamplingParams(grammar="g", grammar_after=5).to_dict()).grammar_after == 5


def test_tool_choice_grammar(grammars, tok):
    """Walks under the tool_choice grammar (leaning towards GLM's markers, so values end) always
    parse as complete calls of the allowed functions with schema keys."""
    from glm53.server.router.parsers.tool_calls import parse_tool_calls
    from glm53.server.router.parsers.tool_grammar import tool_call_lark

    tools = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
             "get_time": {"type": "object", "properties": {}}, "free": {}}
    markers = [tok.token_to_id(t) for t in ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                            "</arg_value>")] + list(tok.eos_token_ids)
    gen = torch.Generator().manual_seed(1)
    for only, parallel in ((None, True), (None, False), ("get_weather", True), ("free", True)):
        lark = tool_call_lark(tok.token_to_id, tools, only, parallel)
        g = grammar_for("lark", lark, "tool_choice")
        grammars.check(g, "tool_choice")
        for _ in range(4):
            c, out = Constraint(grammars.matcher(g), grammars.vocab_size), []
            for _ in range(300):
                allowed = c.allowed()
                pref = [m for m in markers if allowed[m]]
                if pref and torch.rand((), generator=gen) < 0.3:
                    t = pref[int(torch.randint(len(pref), (1,), generator=gen))]
                else:
                    ids = allowed.nonzero().flatten()
                    t = int(ids[torch.randint(len(ids), (1,), generator=gen)])
                if t in tok.eos_token_ids:
                    break
                out.append(t)
                c.advance([t])
            else:
                raise AssertionError("no end")
            content, calls = parse_tool_calls(tok.decode(out), tools)
            assert content == "" and calls and all(x.complete for x in calls), tok.decode(out)
            assert len(calls) == 1 or (parallel and only is None)
            for x in calls:
                assert x.name == (only or x.name) and x.name in tools
                if x.name != "free":
                    assert set(json.loads(x.arguments)) <= set(tools[x.name]["properties"])
    assert tool_call_lark(lambda t: None, tools, None, True) is None


def test_installed_llguidance_has_the_api_the_server_uses(model_dir):
    """pyproject's llguidance bound is the first release with every call the server makes:
    before 1.7, LLTokenizer takes a single eos id and `eos_token=[...]` (as Grammars builds it)
    raises TypeError, so structured output crashed every request."""
    import tomllib
    from importlib.metadata import version
    from pathlib import Path

    deps = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    bound = next(d for d in deps["dependencies"] if d.startswith("llguidance"))
    low = re.search(r">=\s*([0-9.]+)", bound).group(1)
    parse = lambda v: tuple((int(x) for x in (re.findall(r"\d+", v) + ["0", "0"])[:3]))  # noqa: E731
    assert parse(version("llguidance")) >= parse(low) >= (1, 7, 0), (version("llguidance"), bound)
    tok = Tokenizer.from_dir(model_dir)
    g = Grammars(tok.tok.to_str(), tok.vocab_size, tok.eos_token_ids)  # as the router and the instances do
    # what the tool-call grammar uses: %json inside Lark, & and ~ on terminals, special tokens
    lark = 'start: <[%d]> v T\nv: %%json {"type": "integer", "x-guidance": {"whitespace_flexible": false}}\n' \
           'T: /[a-c]{0,3}/ & ~/(.|\\n)*bb(.|\\n)*/\n' % tok.token_to_id("<tool_call>")
    for kind, value in (("json_object", None), ("json_schema", {"type": "object"}), ("regex", "a+"),
                        ("ebnf", 'root ::= "a"'), ("lark", lark)):
        grammar = grammar_for(kind, value, kind)
        g.check(grammar, kind)
        c = Constraint(g.matcher(grammar), g.vocab_size)
        assert c.allowed().any()
        c.block_masks([tok.token_to_id("<tool_call>")])  # try_consume_tokens, rollback
