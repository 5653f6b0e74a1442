"""Reasoning and tool-call parsing through the real router (`up` with test-double instances whose
decode plays scripted GLM output token by token): the openai SDK parses every shape, streamed
and not, and the stream assembles to the non-streamed message."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from glm53.server.config import ConfigError
from glm53.server.config_parse import parse_config
from glm53.server.tokenizer import Tokenizer

from .conftest import start_cluster
from .fake_instance import SCRIPT_SEED

MODEL = "glm-5-tiny"
SCRIPTS = [
    # 0: thinking, a short answer, then two calls (GLM ends a calling turn with eos)
    "I need the weather first.</think>Let me look.\n<tool_call>get_weather<arg_key>city</arg_key>"
    "<arg_value>Paris \"FR\"</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
    "<tool_call>get_time</tool_call>",
    # 1: thinking then a plain answer
    "Simple.</think>The answer is 42.",
    # 2: thinking straight into a call (no </think>)
    "Call it<tool_call>get_time</tool_call>",
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def pcluster(tmp_path_factory, model_dir, glm53_cache):
    tmp = tmp_path_factory.mktemp("parsers")
    tok = Tokenizer.from_dir(model_dir)
    scripts = [tok.encode(s) for s in SCRIPTS]
    assert [tok.decode(ids) for ids in scripts] == SCRIPTS  # markup survives skip_special_tokens
    (tmp / "scripts.json").write_text(json.dumps(scripts))
    c = start_cluster(tmp, model_dir, glm53_cache, router={"reasoning_parser": "glm45", "tool_call_parser": "glm47"},
                      env={"FAKE_SCRIPTS": str(tmp / "scripts.json")})
    yield c
    c.stop()


def client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=30)


def ask(c, script: int, stream: bool = False, **kw):
    return client(c).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                             seed=SCRIPT_SEED + script, stream=stream, max_tokens=200, **kw)


def assemble(chunks: list[ChatCompletionChunk]) -> tuple[str, str, list[dict], str | None]:
    reasoning, content, calls, finish = "", "", {}, None
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch.model_dump())
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        extra = d.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        reasoning += extra.get("reasoning_content") or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.id:
                assert tc.index not in calls and tc.type == "function"
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_tool_calls_and_reasoning(pcluster):
    r = ask(pcluster, 0, tools=TOOLS)
    ChatCompletion.model_validate(r.model_dump())
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    msg = ch.message
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "I need the weather first."
    assert msg.content == "Let me look."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [
        ("get_weather", {"city": 'Paris "FR"', "days": 3}), ("get_time", {})]
    assert all(t.id.startswith("call_") and t.type == "function" for t in msg.tool_calls)
    assert r.usage.completion_tokens_details.reasoning_tokens > 0

    chunks = list(ask(pcluster, 0, stream=True, tools=TOOLS, stream_options={"include_usage": True}))
    reasoning, content, calls, finish = assemble(chunks)
    assert (reasoning, content, finish) == ("I need the weather first.", "Let me look.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(t.function.name, t.function.arguments)
                                                            for t in msg.tool_calls]
    # the arguments came in several fragments after the id/name piece
    pieces = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or [] if tc.index == 0]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and len(pieces) > 3
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens_details.reasoning_tokens


def test_reasoning_without_tools_and_thinking_off(pcluster):
    r = ask(pcluster, 1)
    m = r.choices[0].message
    assert (m.model_extra["reasoning_content"], m.content, m.tool_calls) == ("Simple.", "The answer is 42.", [])
    assert r.choices[0].finish_reason == "stop"
    reasoning, content, calls, finish = assemble(list(ask(pcluster, 1, stream=True)))
    assert (reasoning, content, calls, finish) == ("Simple.", "The answer is 42.", [], "stop")
    # Thinking disabled: the prompt closes the block, so everything is the answer.
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"thinking": {"type": "disabled"}}):
        r = ask(pcluster, 1, extra_body=extra)
        assert r.choices[0].message.content == SCRIPTS[1] and r.choices[0].message.model_extra["reasoning_content"] is None


def test_call_ends_reasoning_and_tool_choice(pcluster):
    r = ask(pcluster, 2, tools=TOOLS, tool_choice="required")
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] == "Call it" and m.content is None
    assert [t.function.name for t in m.tool_calls] == ["get_time"] and r.choices[0].finish_reason == "tool_calls"
    # tool_choice none: no tools in the prompt, no parsing
    r = ask(pcluster, 2, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == "<tool_call>get_time</tool_call>" and r.choices[0].finish_reason == "stop"
    tok = httpx.post(pcluster.url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    assert tok.status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    for extra in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, {"tool_choice": "maybe"},
                  {"tool_choice": "required", "response_format": {"type": "json_object"}}):
        e = httpx.post(pcluster.url + "/v1/chat/completions", json={**body, **extra})
        assert e.status_code == 400 and e.json()["error"]["param"] == "tool_choice", e.text
    # an assistant turn with calls (arguments as JSON text) and a tool result render and run
    hist = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = client(pcluster).chat.completions.create(model=MODEL, messages=hist, tools=TOOLS, seed=SCRIPT_SEED + 1,
                                                 max_tokens=50)
    assert r.choices[0].message.content == "The answer is 42."


def test_parser_names_in_config():
    base = {"prefill": [{"host": "127.0.0.1", "port": 1, "bootstrap_port": 2}],
            "decode": [{"host": "127.0.0.1", "port": 3}]}
    cfg = parse_config({**base, "router": {"reasoning_parser": "glm45", "tool_call_parser": "glm47"}})
    assert (cfg.router.reasoning_parser, cfg.router.tool_call_parser) == ("glm45", "glm47")
    for key in ("reasoning_parser", "tool_call_parser"):
        with pytest.raises(ConfigError) as e:
            parse_config({**base, "router": {key: "qwen3"}})
        assert e.value.key == f"router.{key}" and "qwen3" in str(e.value)
