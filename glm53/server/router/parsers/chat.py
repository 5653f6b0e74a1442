"""What a chat request's output becomes: reasoning, answer text and tool calls.

`ChatParsing.for_request` reads the router's parsers (router.reasoning_parser,
router.tool_call_parser), the request's `tools` / `tool_choice` / `parallel_tool_calls` and the
prompt (does it open a thinking block?), and checks `tool_choice` (a 400 naming it). Then:
- `message(text)`: the non-streamed `message` and whether a call was completed (a call cut off
  before its `</tool_call>`, by max_tokens, stays content: its markup as generated);
- `stream()`: a `ChatStream` that turns text deltas into OpenAI delta objects
  (`reasoning_content` + `reasoning`, `content`, `tool_calls` pieces: index, id, type and name
  first, then `function.arguments` fragments).

`tool_choice`: "none" renders no tools and parses no calls; "auto", "required" and a named
function render the tools and parse calls. "required" and a named function are enforced while
generating by a grammar of the call markup whose arguments follow each function's parameter
schema (`forced_calls`, tool_grammar.py; after `</think>` when the model thinks first). With `parallel_tool_calls: false` only the first call is
returned (and a "required" grammar allows one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from glm53.server.router.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from glm53.server.router.parsers.reasoning import (THINK_END, THINK_START, TOOL_START, ReasoningStream,
                                                   prompt_opens_reasoning, split_reasoning)
from glm53.server.router.parsers.tool_calls import ToolCallStream, parse_tool_calls
from glm53.server.router.parsers.tool_grammar import tool_call_lark
from glm53.server.router.schemas import APIError


def check_tool_choice(body: Any, tool_parser: str | None) -> str | None:
    """The named function of `tool_choice` ("required" and "auto" give None); APIError for a
    choice the request cannot have."""
    choice = body.tool_choice
    names = [t.function.name for t in body.tools or []]
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required" or isinstance(choice, dict):
        if not names:
            raise APIError(400, "tool_choice requires tools: the request lists none", "tool_choice")
        if tool_parser is None:
            raise APIError(400, "tool_choice 'required' or a named function needs a tool-call parser: start the "
                           "server with --tool-call-parser glm47 (router.tool_call_parser)", "tool_choice")
    if choice == "required":
        return None
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type", "function") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                           '"function": {"name": ...}}', "tool_choice")
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools "
                           f"({', '.join(names)})", "tool_choice")
        return name
    raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named function; got {choice!r}',
                   "tool_choice")


def template_tools(body: Any) -> list[dict[str, Any]] | None:
    """The tools the chat template shows the model (none for tool_choice "none")."""
    if not body.tools or getattr(body, "tool_choice", None) == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in body.tools]


def template_messages(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for the template: an assistant call's `arguments` JSON text becomes the object
    GLM's template iterates over (text that is not a JSON object is left as is)."""
    for m in msgs:
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            if isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except ValueError:
                    continue
                if isinstance(args, dict):
                    fn["arguments"] = args
    return msgs


def thinking_kwargs(body: Any) -> dict[str, Any]:
    """Z.ai's `thinking: {"type": "enabled"|"disabled", "clear_thinking": bool}` as the
    template's `enable_thinking` / `clear_thinking`."""
    thinking = (getattr(body, "model_extra", None) or {}).get("thinking")
    if not isinstance(thinking, dict):
        return {}
    out: dict[str, Any] = {}
    if thinking.get("type") in ("enabled", "disabled"):
        out["enable_thinking"] = thinking["type"] == "enabled"
    if isinstance(thinking.get("clear_thinking"), bool):
        out["clear_thinking"] = thinking["clear_thinking"]
    return out


@dataclass
class ChatParsing:
    reasoning: bool  # split reasoning from the answer
    in_reasoning: bool  # the prompt opened a thinking block
    tools: dict[str, Any] | None  # function name -> parameters; None: no tool-call parsing
    parallel: bool = True

    @classmethod
    def for_request(cls, cfg_router: Any, body: Any, prompt_tail: str) -> "ChatParsing":
        rp, tp = cfg_router.reasoning_parser, cfg_router.tool_call_parser
        assert (rp is None or rp in REASONING_PARSERS) and (tp is None or tp in TOOL_CALL_PARSERS)
        tools = None
        if tp is not None and body.tools and body.tool_choice != "none":
            tools = {t.function.name: t.function.parameters or {} for t in body.tools}
        parallel = (body.model_extra or {}).get("parallel_tool_calls", True) is not False
        return cls(reasoning=rp is not None, in_reasoning=rp is not None and prompt_opens_reasoning(prompt_tail),
                   tools=tools, parallel=parallel)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        reasoning, answer = split_reasoning(text, self.in_reasoning) if self.reasoning else ("", text)
        calls: list[dict[str, Any]] = []
        complete = False
        content: str | None = answer
        if self.tools is not None:
            content, parsed = parse_tool_calls(answer, self.tools)
            if parsed and not parsed[-1].complete:
                # Cut off (max_tokens) before its </tool_call>: not a call. Its markup stays
                # content, as vLLM's parser leaves it (a stream has sent its pieces already; its
                # finish_reason "length" says the last call is incomplete).
                cut = parsed[-1].start
                content, parsed = parse_tool_calls(answer[:cut], self.tools)
                content += answer[cut:]
            if not self.parallel:
                parsed = parsed[:1]
            calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                     for c in parsed]
            complete = any(c.complete for c in parsed)
            if calls and not content:
                content = None
        msg = {"role": "assistant", "content": content, "tool_calls": calls}
        if self.reasoning:
            msg["reasoning_content"] = msg["reasoning"] = reasoning or None
        return msg, complete

    def forced_calls(self, body: Any, token_id: Any) -> str | None:
        """The Lark grammar that enforces tool_choice "required" or a named function (None for
        "auto"/"none", without the tool-call parser, or when GLM's markers are not single
        tokens)."""
        choice = body.tool_choice
        if self.tools is None or not (choice == "required" or isinstance(choice, dict)):
            return None
        only = check_tool_choice(body, "glm47")
        return tool_call_lark(token_id, self.tools, only, self.parallel)

    def stream(self) -> "ChatStream":
        return ChatStream(self)

    def reasoning_tokens(self, ids: list[int], token_id: Any) -> int:
        """Output tokens spent thinking: those before the token that ends the thinking block
        (`</think>` or `<tool_call>`), without an opening `<think>`; all of them when it never
        ended. 0 when the reasoning parser is off or the markers are not single tokens."""
        if not self.reasoning or not ids:
            return 0
        start, ends = token_id(THINK_START), {token_id(THINK_END), token_id(TOOL_START)} - {None}
        if start is None or len(ends) < 2:
            return 0
        first = 1 if ids[0] == start else 0
        if not self.in_reasoning and not first:
            return 0
        end = next((i for i, t in enumerate(ids) if t in ends), len(ids))
        return max(0, end - first)


class ChatStream:
    """Text deltas in, OpenAI `delta` objects out (one per kind of output, in order)."""

    def __init__(self, parsing: ChatParsing):
        self.p = parsing
        self.think = ReasoningStream(parsing.in_reasoning) if parsing.reasoning else None
        self.calls = ToolCallStream(parsing.tools) if parsing.tools is not None else None

    @property
    def complete_calls(self) -> int:
        if self.calls is None:
            return 0
        return self.calls.n_complete if self.p.parallel else min(1, self.calls.n_complete)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.think is None:
            return self._answer(text, False)
        d = self.think.feed(text)
        return self._reasoning(d.reasoning) + self._answer(d.answer, False)

    def finish(self) -> list[dict[str, Any]]:
        if self.think is None:
            return self._answer("", True)
        d = self.think.finish()
        return self._reasoning(d.reasoning) + self._answer(d.answer, True)

    @staticmethod
    def _reasoning(text: str) -> list[dict[str, Any]]:
        return [{"reasoning_content": text, "reasoning": text}] if text else []

    def _answer(self, text: str, last: bool) -> list[dict[str, Any]]:
        if self.calls is None:
            return [{"content": text}] if text else []
        d = self.calls.feed(text) if text else None
        out = [d] if d else []
        if last:
            out.append(self.calls.finish())
        events: list[dict[str, Any]] = []
        for td in out:
            if td.content:
                events.append({"content": td.content})
            pieces: list[dict[str, Any]] = []
            for c in td.calls:
                if not self.p.parallel and c.index > 0:
                    continue
                if c.id is not None:
                    pieces.append({"index": c.index, "id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}})
                elif pieces and pieces[-1]["index"] == c.index:
                    pieces[-1]["function"]["arguments"] += c.arguments
                else:
                    pieces.append({"index": c.index, "function": {"arguments": c.arguments}})
            if pieces:
                events.append({"tool_calls": pieces})
        return events
