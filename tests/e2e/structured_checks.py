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


def validates(instance, schema: dict) -> bool:
    """Whether `instance` validates against the JSON `schema`: jsonschema-rs (schemathesis brings
    it) or jsonschema where installed, else a small checker of the keywords the tests use."""
    try:
        import jsonschema_rs
        return jsonschema_rs.validator_for(schema).is_valid(instance)
    except ImportError:
        pass
    try:
        import jsonschema
        return jsonschema.Draft202012Validator(schema).is_valid(instance)
    except ImportError:
        return _small_check(instance, schema, schema)


def _small_check(x, s, root) -> bool:
    if s is True or s == {}:
        return True
    if s is False:
        return False
    if "$ref" in s:
        target = root
        for part in s["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return _small_check(x, target, root)
    kinds = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}
    t = s.get("type")
    if t is not None:
        def is_type(k):
            if k in ("integer", "number"):
                return isinstance(x, (int, float)) and not isinstance(x, bool) and (k == "number" or x == int(x))
            return isinstance(x, kinds[k])
        if not any(is_type(k) for k in ([t] if isinstance(t, str) else t)):
            return False
    if "enum" in s and x not in s["enum"] or "const" in s and x != s["const"]:
        return False
    if "anyOf" in s and not any(_small_check(x, b, root) for b in s["anyOf"]):
        return False
    if isinstance(x, str):
        if len(x) < s.get("minLength", 0) or len(x) > s.get("maxLength", len(x)):
            return False
        if "pattern" in s and not re.search(s["pattern"], x):
            return False
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        if x < s.get("minimum", x) or x > s.get("maximum", x):
            return False
    if isinstance(x, list):
        if len(x) > s.get("maxItems", len(x)) or not all(_small_check(v, s.get("items", {}), root) for v in x):
            return False
    if isinstance(x, dict):
        if any(k not in x for k in s.get("required", [])):
            return False
        props = s.get("properties", {})
        if s.get("additionalProperties") is False and set(x) - set(props):
            return False
        return all(_small_check(v, props.get(k, {}), root) for k, v in x.items())
    return True


# get_weather requires city and days (issue 32: "{}" used to come back); its values end by
# themselves (bounded string, bounded integer, an enum), so a call completes within max_tokens.
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["c", "f"]}, "alerts": {"type": "boolean"}}, "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_call(call, names=tuple(SCHEMAS)) -> dict:
    """A returned tool call: one of `names`, arguments that validate against its schema."""
    args = json.loads(call.function.arguments)
    assert call.function.name in names and validates(args, SCHEMAS[call.function.name]), call
    return args


def check_forced_tool_calls(cluster):
    """tool_choice "required" / a named function, enforced by the call grammar with each call's
    arguments constrained by the tool's parameter schema (needs the cluster's
    router.tool_call_parser): greedy and sampled, streamed and not, every call validates."""
    c = client(cluster)
    msgs = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, names in (("required", ("get_time", "get_weather")), (named, ("get_weather",))):
        for kw in ({"temperature": 0}, *({"temperature": 1.0, "seed": s} for s in range(4))):
            r = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=choice, max_tokens=64,
                                          parallel_tool_calls=False, extra_body=NOTHINK, **kw)
            m = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls" and m.content is None and len(m.tool_calls) == 1, r
            args = check_call(m.tool_calls[0], names)
            if m.tool_calls[0].function.name == "get_weather":
                assert {"city", "days"} <= set(args), args
    # streamed: the pieces assemble to a call that validates
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=64,
                                            extra_body=NOTHINK, temperature=1.0, seed=11, stream=True))
    pieces = [t for ch in chunks if ch.choices for t in (ch.choices[0].delta.tool_calls or [])]
    assert pieces and pieces[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    args = json.loads("".join(p.function.arguments or "" for p in pieces))
    assert validates(args, WEATHER) and {"city", "days"} <= set(args), args
