"""The chat output parsers (server/router/parsers): GLM reasoning and tool calls, whole and
streamed. Every stream test feeds the text cut at every character boundary (two pieces) and one
character at a time, and checks the assembled result equals the whole-text parse."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from glm53.server.router.parsers.arguments import argument_types, convert_value
from glm53.server.router.parsers.chat import ChatParsing, check_tool_choice, template_messages
from glm53.server.router.parsers.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning
from glm53.server.router.parsers.tool_calls import ToolCallStream, parse_tool_calls
from glm53.server.router.schemas import APIError, ChatCompletionRequest

TOOLS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
        "opts": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
        "flag": {"type": "boolean"}, "maybe": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "unit": {"enum": ["c", "f"]}, "ref": {"$ref": "#/$defs/n"}},
        "$defs": {"n": {"type": "integer"}}},
    "get_time": {},
}

CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Bei \"jing\" <b>\n</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value><arg_key>opts</arg_key><arg_value>{\"a\": [1, 2]}"
        "</arg_value><arg_key>tags</arg_key><arg_value>['x', 'y']</arg_value><arg_key>flag</arg_key>"
        "<arg_value>True</arg_value><arg_key>ref</arg_key><arg_value>7</arg_value></tool_call>")
TEXTS = [
    "plain answer, no markup at all <",
    "Let me check.\n" + CALL + "\n<tool_call>get_time</tool_call>\n",
    # GLM-4.5 layout: newlines between the parts
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "text " + CALL + " between " + CALL + " after",
    # malformed: missing <arg_key> after the name line, missing </arg_value>
    "<tool_call>get_weather\ncity</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>2</tool_call>",
    # cut off: mid string value, mid number, before the name was complete
    "a <tool_call>get_weather<arg_key>city</arg_key><arg_value>Ber",
    "<tool_call>get_weather<arg_key>days</arg_key><arg_value>1",
    "so <tool_call>get_wea",
    "<tool_call>unknown_fn<arg_key>x</arg_key><arg_value>5</arg_value></tool_call>",
]


def splits(text: str):
    """Every way of cutting `text` in two, then one character at a time."""
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]
    yield list(text)


def stream_tools(pieces: list[str]) -> tuple[str, list[dict]]:
    s = ToolCallStream(TOOLS)
    content, calls = "", {}
    for d in [s.feed(p) for p in pieces] + [s.finish()]:
        content += d.content
        for c in d.calls:
            if c.id is not None:
                assert c.index not in calls and c.index == len(calls)
                calls[c.index] = {"name": c.name, "arguments": ""}
            calls[c.index]["arguments"] += c.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("text", TEXTS)
def test_tool_calls_stream_equals_whole(text):
    content, parsed = parse_tool_calls(text, TOOLS)
    whole = [{"name": c.name, "arguments": c.arguments} for c in parsed]
    for pieces in splits(text):
        assert stream_tools(pieces) == (content, whole), pieces


def test_tool_call_values_typed_by_schema():
    content, calls = parse_tool_calls("Let me check.\n" + CALL + "\n<tool_call>get_time</tool_call>\n", TOOLS)
    assert content == "Let me check." and [c.complete for c in calls] == [True, True]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert json.loads(calls[0].arguments) == {"city": 'Bei "jing" <b>\n', "days": 3, "opts": {"a": [1, 2]},
                                              "tags": ["x", "y"], "flag": True, "ref": 7}
    assert (calls[1].name, calls[1].arguments) == ("get_time", "{}")
    _, calls = parse_tool_calls(TEXTS[2], TOOLS)
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    _, calls = parse_tool_calls(TEXTS[4], TOOLS)  # repaired
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo", "days": 2}
    content, calls = parse_tool_calls(TEXTS[5], TOOLS)  # cut off: truncated arguments, not complete
    assert content == "a" and calls[0].arguments == '{"city": "Ber' and not calls[0].complete
    assert parse_tool_calls(TEXTS[7], TOOLS) == ("so <tool_call>get_wea", [])
    assert parse_tool_calls(TEXTS[0], TOOLS) == (TEXTS[0], [])


def test_argument_conversion():
    p = TOOLS["get_weather"]
    assert argument_types(p, "days") == {"integer"} and argument_types(p, "temp") == {"number", "integer"}
    assert argument_types(p, "unit") == {"string"} and argument_types(p, "ref") == {"integer"}
    assert argument_types(p, "nope") is None and argument_types({}, "x") is None
    assert convert_value("007", {"string"}) == "007"
    assert convert_value("3.0", {"integer"}) == 3 and convert_value("2.5", {"number", "integer"}) == 2.5
    assert convert_value("2.5", {"integer"}) == "2.5"  # not an integer: kept as text
    assert convert_value("null", {"string", "null"}) is None and convert_value("hi", {"string", "null"}) == "hi"
    assert convert_value("[1, 2]", None) == [1, 2] and convert_value("abc", None) == "abc"
    assert convert_value("NaN", {"number"}) == "NaN" and convert_value("{bad", {"object"}) == "{bad"


REASONING = ["thinking hard</think>The answer.", "<think>opened by the model</think>answer",
             "  <think>x</think>", "no end of thinking <", "step<tool_call>get_time</tool_call>",
             "answer with </think> inside", "<thin", " \n "]


@pytest.mark.parametrize("in_reasoning", [True, False])
@pytest.mark.parametrize("text", REASONING)
def test_reasoning_stream_equals_whole(text, in_reasoning):
    whole = split_reasoning(text, in_reasoning)
    for pieces in splits(text):
        s = ReasoningStream(in_reasoning)
        got = [s.feed(p) for p in pieces] + [s.finish()]
        assert ("".join(d.reasoning for d in got), "".join(d.answer for d in got)) == whole, pieces


def test_reasoning_rules():
    assert split_reasoning("R</think>A", True) == ("R", "A")
    assert split_reasoning("R</think>A", False) == ("", "R</think>A")
    assert split_reasoning("<think>R</think>A", False) == ("R", "A")
    assert split_reasoning("R<tool_call>f</tool_call>", True) == ("R", "<tool_call>f</tool_call>")
    assert split_reasoning("cut off", True) == ("cut off", "")
    assert prompt_opens_reasoning("[gMASK]<sop><|user|>hi<|assistant|><think>")
    assert not prompt_opens_reasoning("<|user|>hi<|assistant|></think>")


def chat_body(**kw) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in TOOLS.items()]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools, **kw})


ROUTER = SimpleNamespace(reasoning_parser="glm45", tool_call_parser="glm47")


@pytest.mark.parametrize("text", [
    "I should call.</think>Calling." + CALL,
    "thought<tool_call>get_time</tool_call>",
    "thought</think>\n\n" + CALL + "\n",
    "thought</think>plain answer\n",
    "still thinking when cut off",
])
def test_chat_stream_equals_message(text):
    p = ChatParsing.for_request(ROUTER, chat_body(), "<|assistant|><think>")
    msg, complete = p.message(text)
    for pieces in splits(text):
        s = p.stream()
        deltas = [d for piece in pieces for d in s.feed(piece)] + s.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        calls: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                if "id" in c:
                    calls[c["index"]] = {"name": c["function"]["name"], "arguments": ""}
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
        assert reasoning == (msg["reasoning_content"] or "") and content == (msg["content"] or "")
        assert list(calls.values()) == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                        for c in msg["tool_calls"]]
        assert (s.complete_calls > 0) == complete


def test_chat_message_shapes():
    p = ChatParsing.for_request(ROUTER, chat_body(), "<|assistant|><think>")
    msg, complete = p.message("R</think>\n<tool_call>get_time</tool_call>")
    assert msg["content"] is None and msg["reasoning_content"] == msg["reasoning"] == "R" and complete
    assert msg["tool_calls"][0]["type"] == "function" and msg["tool_calls"][0]["function"]["arguments"] == "{}"
    # thinking disabled: the prompt closed the block, so all of it is the answer
    p = ChatParsing.for_request(ROUTER, chat_body(), "<|assistant|></think>")
    assert p.message("plain")[0] == {"role": "assistant", "content": "plain", "tool_calls": [],
                                     "reasoning_content": None, "reasoning": None}
    # tool_choice none, or no parser: no calls parsed
    p = ChatParsing.for_request(ROUTER, chat_body(tool_choice="none"), "")
    assert p.message("<tool_call>get_time</tool_call>")[0]["content"] == "<tool_call>get_time</tool_call>"
    p = ChatParsing.for_request(SimpleNamespace(reasoning_parser=None, tool_call_parser=None), chat_body(), "<think>")
    assert p.message("R</think><tool_call>x</tool_call>")[0] == {
        "role": "assistant", "content": "R</think><tool_call>x</tool_call>", "tool_calls": []}
    # parallel_tool_calls false: the first call only
    p = ChatParsing.for_request(ROUTER, chat_body(parallel_tool_calls=False), "")
    two = "<tool_call>get_time</tool_call><tool_call>get_time</tool_call>"
    assert len(p.message(two)[0]["tool_calls"]) == 1
    s = p.stream()
    assert [c["index"] for d in s.feed(two) + s.finish() for c in d.get("tool_calls", [])] == [0]


def test_reasoning_tokens():
    ids = {"<think>": 1, "</think>": 2, "<tool_call>": 3}
    p = ChatParsing.for_request(ROUTER, chat_body(), "<think>")
    assert p.reasoning_tokens([9, 9, 9, 2, 8], ids.get) == 3 and p.reasoning_tokens([9, 9], ids.get) == 2
    assert p.reasoning_tokens([9, 3, 8], ids.get) == 1
    p = ChatParsing.for_request(ROUTER, chat_body(), "</think>")
    assert p.reasoning_tokens([9, 9], ids.get) == 0 and p.reasoning_tokens([1, 9, 9, 2], ids.get) == 2


def test_tool_choice_checks():
    assert check_tool_choice(chat_body(tool_choice={"type": "function", "function": {"name": "get_time"}}),
                             "glm47") == "get_time"
    assert check_tool_choice(chat_body(tool_choice="required"), "glm47") is None
    for choice, parser in (({"type": "function", "function": {"name": "nope"}}, "glm47"), ("sometimes", "glm47"),
                           ("required", None), ({"type": "function"}, "glm47")):
        with pytest.raises(APIError) as e:
            check_tool_choice(chat_body(tool_choice=choice), parser)
        assert e.value.param == "tool_choice" and e.value.status == 400
    no_tools = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                     "tool_choice": "required"})
    with pytest.raises(APIError):
        check_tool_choice(no_tools, "glm47")


def test_template_messages_arguments_become_objects():
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}},
                                                 {"function": {"name": "g", "arguments": "not json"}}]}]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json"
