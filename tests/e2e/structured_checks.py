"""Structured-output checks run through the real PD pipeline (router -> prefill -> KV transfer ->
decode) on the e2e clusters (test_pd_serving.py: plain decoding; test_dflash.py: DFlash with a
random draft, whose drafts the grammar mostly refuses, so what is committed must follow the
grammar at every block position). The tiny model writes Python, never JSON: every answer must
still parse against the schema / match the regex / follow the grammar, greedy and sampled,
streamed and not. (They ride on those modules' clusters: a cluster of its own costs ~20 s.)"""

from __future__ import annotations

import json
import re

import httpx
import openai

MODEL = "glm-5-tiny"
SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
    "tag": {"enum": ["red", "green", "blue"]}, "name": {"type": "string", "maxLength": 8}},
    "required": ["n", "ok", "tag", "name"], "additionalProperties": False}
REGEX = r"[a-c]{3}-[0-9]{2}"
EBNF = 'root ::= "yes" | "no" | "maybe " number\nnumber ::= [0-9] [0-9]?'
SAMPLING = [{"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}]
NOTHINK = {"chat_template_kwargs": {"enable_thinking": False}}


def check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"n", "ok", "tag", "name"}, text
    assert isinstance(obj["n"], int) and not isinstance(obj["n"], bool) and 0 <= obj["n"] <= 999, text
    assert isinstance(obj["ok"], bool) and obj["tag"] in ("red", "green", "blue"), text
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8, text


def client(c) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", timeout=120, max_retries=0)


def check_chat_json_schema_and_json_object(cluster, sampling: list[dict] = SAMPLING, json_object: bool = True):
    c = client(cluster)
    msgs = [{"role": "user", "content": "A JSON object, please."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    for kw in sampling:
        r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, response_format=fmt,
                                      extra_body=NOTHINK, **kw)
        assert r.choices[0].finish_reason == "stop", r
        check_schema(r.choices[0].message.content)
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=80, response_format=fmt,
                                            extra_body=NOTHINK, stream=True, temperature=1.0, seed=7))
    check_schema("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
    if not json_object:
        return
    r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, response_format={"type": "json_object"},
                                  extra_body=NOTHINK, temperature=0)
    if r.choices[0].finish_reason == "stop":  # an open-ended object may run out of tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def check_generate_regex(cluster, kw: dict) -> None:
    sp = {"max_new_tokens": 32, **{("sampling_seed" if k == "seed" else k): v for k, v in kw.items()}}
    r = httpx.post(cluster.url + "/generate", json={"text": "def f():", "sampling_params": {**sp, "regex": REGEX}},
                   timeout=120).json()
    assert re.fullmatch(REGEX, r["text"]) and r["meta_info"]["finish_reason"]["type"] == "stop", r


def check_generate_regex_ebnf_schema_and_completions(cluster):
    for kw in SAMPLING:
        check_generate_regex(cluster, kw)
    sp = {"max_new_tokens": 32, "temperature": 1.0, "sampling_seed": 5}
    r = httpx.post(cluster.url + "/generate", json={"text": "x", "sampling_params": {**sp, "ebnf": EBNF}},
                   timeout=120).json()
    assert re.fullmatch(r"yes|no|maybe [0-9][0-9]?", r["text"]), r
    r = httpx.post(cluster.url + "/generate", json={
        "input_ids": [400, 401, 402], "sampling_params": {**sp, "max_new_tokens": 80,
                                                          "json_schema": json.dumps(SCHEMA)}}, timeout=120).json()
    check_schema(r["text"])
    r = client(cluster).completions.create(model=MODEL, prompt="import os", max_tokens=80, temperature=1.0, seed=4,
                                           extra_body={"response_format": {"type": "json_schema",
                                                                           "json_schema": {"schema": SCHEMA}}})
    check_schema(r.choices[0].text)


def check_bad_grammars_are_400_naming_the_field(cluster):
    def post(path, body):
        r = httpx.post(cluster.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        return r.json()["error"]["param"]

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    assert post("/v1/chat/completions", {**chat, "response_format": bad_schema}) == "response_format.json_schema"
    assert post("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}}) \
        == "response_format.json_schema"
    assert post("/v1/chat/completions", {**chat, "response_format": {"type": "yaml"}}) == "response_format.type"
    assert post("/generate", {"text": "x", "sampling_params": {"regex": "[a-"}}) == "sampling_params.regex"
    assert post("/generate", {"text": "x", "sampling_params": {"json_schema": "{not json"}}) == "sampling_params.json_schema"
    assert post("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= ("}}) == "sampling_params.ebnf"
    assert post("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}) == "sampling_params.ebnf"


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}}}}]


def check_forced_tool_calls(cluster):
    """tool_choice "required" / a named function, enforced by the call grammar (needs the
    cluster's router.tool_call_parser)."""
    c = client(cluster)
    msgs = [{"role": "user", "content": "What time is it?"}]
    for kw in SAMPLING[:1]:
        r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=48,
                                      parallel_tool_calls=False, extra_body=NOTHINK, **kw)
        m = r.choices[0].message
        assert m.content is None and len(m.tool_calls) == 1 and m.tool_calls[0].function.name in ("get_time", "get_weather")
        if m.tool_calls[0].function.name == "get_time":
            assert m.tool_calls[0].function.arguments == "{}" and r.choices[0].finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=24,
                                  extra_body=NOTHINK, temperature=1.0, seed=3)
    m = r.choices[0].message
    # The model writes the city until it closes the value: complete or cut off by max_tokens.
    assert m.content is None and [t.function.name for t in m.tool_calls] == ["get_weather"], m
    args = m.tool_calls[0].function.arguments
    assert args == "{}" or args.startswith('{"city": "'), args
