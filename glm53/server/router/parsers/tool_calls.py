"""The `glm47` tool-call parser: GLM-4.7/GLM-5 calls as OpenAI `tool_calls`.

GLM writes a call as `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`
(whitespace between the parts is allowed, as GLM-4.5 puts newlines there), several calls back
to back, with answer text around them. Each call becomes `{id, type: "function", function:
{name, arguments}}`, `arguments` a JSON object text whose values are typed by the tool's schema
(arguments.py).

The text is cut into tags and text between them, and one `_Call` state machine per call turns
those events into the call's name and argument JSON, fragment by fragment: a string value is
streamed as it arrives, any other value when it is complete. `parse_tool_calls` (a whole text)
and `ToolCallStream` (deltas; text that could start a tag is held until the next delta) feed the
same machine, so a stream assembles to exactly the whole-text result. Malformed output is
handled as GLM's known slips suggest: a missing `<arg_key>` after a name on its own line, a
missing `</arg_key>` or `</arg_value>`; a call cut off before its name is complete stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from glm53.server.router.parsers.arguments import argument_types, convert_value, is_string_only
from glm53.server.router.parsers.reasoning import partial_suffix

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VAL_START, VAL_END = "<arg_value>", "</arg_value>"
CALL_TAGS = (KEY_START, KEY_END, VAL_START, VAL_END, CALL_END)
_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in (CALL_START, *CALL_TAGS)) + ")")


@dataclass
class CallDelta:
    """A piece of tool call `index`: its id and name (first piece only) or an arguments fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str
    complete: bool  # closed by </tool_call>
    start: int = -1  # where its <tool_call> begins in the text parse_tool_calls was given


def _esc(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)[1:-1]


class _Call:
    """One call: tag and text events in, CallDeltas out."""

    def __init__(self, index: int, tools: dict[str, Any]):
        self.index, self.tools = index, tools
        self.phase = "name"  # name -> (key -> wait_value -> value -> between)* -> closed
        self.raw = CALL_START  # the call's text while its name is incomplete (it may stay text)
        self.name = ""
        self.key = ""
        self.value = ""
        self.string_value = False
        self.types: set[str] | None = None
        self.first = True
        self.started = False  # the id/name delta went out

    def _start(self, name: str) -> list[CallDelta]:
        self.name, self.started = name.strip(), True
        return [CallDelta(self.index, "call_" + uuid.uuid4().hex[:24], self.name)]

    def _close(self) -> list[CallDelta]:
        frag = ""
        if self.phase == "value":
            frag = self._end_value()
        self.phase = "closed"
        return [CallDelta(self.index, arguments=frag + ("{}" if self.first else "}"))]

    def _key_done(self) -> None:
        self.key = self.key.strip()
        self.types = argument_types((self.tools.get(self.name) or {}), self.key)
        self.phase = "wait_value"

    def _end_value(self) -> str:
        self.phase = "between"
        if self.string_value:
            return '"'
        return json.dumps(convert_value(self.value, self.types), ensure_ascii=False)

    def text(self, s: str) -> list[CallDelta]:
        if self.phase == "name":
            self.raw += s
            self.name += s
        elif self.phase == "key":
            self.key += s
        elif self.phase == "value":
            if self.string_value:
                return [CallDelta(self.index, arguments=_esc(s))] if s else []
            self.value += s
        return []  # between the parts: whitespace (or stray text) is not part of the call

    def tag(self, t: str) -> list[CallDelta]:
        p = self.phase
        if p == "name":
            self.raw += t
            if t == CALL_END:
                return self._start(self.name) + self._close()
            if t == KEY_START:
                out = self._start(self.name)
                self.phase, self.key = "key", ""
                return out
            if t == KEY_END:
                # "NAME\nKEY</arg_key>": the <arg_key> was left out.
                parts = self.name.strip().split("\n", 1)
                if len(parts) == 2:
                    out = self._start(parts[0])
                    self.key = parts[1]
                    self._key_done()
                    return out
            self.name += t
            return []
        if p == "value":
            if t == VAL_END:
                return [CallDelta(self.index, arguments=self._end_value())]
            if t == CALL_END:
                return self._close()
            return self.text(t)  # another tag inside a value is text of that value
        if t == CALL_END:
            return self._close()
        if t == KEY_START:  # (a key without its value is dropped)
            self.phase, self.key = "key", ""
        elif p == "key" and t in (KEY_END, VAL_START):
            self._key_done()
            if t == VAL_START:
                return self.tag(t)
        elif p == "wait_value" and t == VAL_START:
            self.string_value = is_string_only(self.types)
            head = ("{" if self.first else ", ") + json.dumps(self.key, ensure_ascii=False) + ": "
            self.first, self.phase, self.value = False, "value", ""
            return [CallDelta(self.index, arguments=head + ('"' if self.string_value else ""))]
        return []


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class _Assembler:
    """Content and call deltas to the final message: answer text and the calls."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, ParsedCall] = {}

    def add(self, d: ToolDelta) -> None:
        self.content.append(d.content)
        for c in d.calls:
            if c.id is not None:
                self.calls[c.index] = ParsedCall(c.id, c.name or "", "", False)
            self.calls[c.index].arguments += c.arguments


class ToolCallStream:
    """Tool calls out of answer text that arrives in pieces: `feed` deltas, then `finish()`.

    While calls are parsed, content that is only whitespace so far is held back: whitespace
    around calls is dropped when the output has calls (and kept when it has none)."""

    def __init__(self, tools: dict[str, Any]):
        self.tools = tools  # function name -> its parameters schema
        self._buf = ""
        self._ws = ""
        self.call: _Call | None = None
        self.n_calls = 0  # calls started (their name is out)
        self.n_complete = 0  # calls closed by </tool_call>

    def _content(self, s: str) -> str:
        both = self._ws + s
        kept = both.rstrip()
        self._ws = both[len(kept):]
        return kept

    def _on_call(self, out: ToolDelta, deltas: list[CallDelta]) -> None:
        assert self.call is not None
        out.calls.extend(deltas)
        if self.call.phase == "closed":
            self.n_complete += 1
            self.call = None

    def feed(self, delta: str) -> ToolDelta:
        out = ToolDelta()
        buf = self._buf + delta
        while buf:
            if self.call is None:
                i = buf.find(CALL_START)
                if i < 0:
                    hold = partial_suffix(buf, (CALL_START,))
                    out.content += self._content(buf[:len(buf) - hold])
                    buf = buf[len(buf) - hold:]
                    break
                out.content += self._content(buf[:i])
                self.call = _Call(self.n_calls, self.tools)
                buf = buf[i + len(CALL_START):]
                continue
            hits = [(buf.find(t), t) for t in CALL_TAGS if t in buf]
            if not hits:
                hold = partial_suffix(buf, CALL_TAGS)
                self._on_call(out, self._count(self.call.text(buf[:len(buf) - hold])))
                buf = buf[len(buf) - hold:]
                break
            i, tag = min(hits)
            call = self.call
            deltas = self._count(call.text(buf[:i])) + self._count(call.tag(tag))
            self._on_call(out, deltas)
            buf = buf[i + len(tag):]
        self._buf = buf
        return out

    def _count(self, deltas: list[CallDelta]) -> list[CallDelta]:
        self.n_calls += sum(1 for d in deltas if d.id is not None)
        return deltas

    def finish(self) -> ToolDelta:
        buf, self._buf = self._buf, ""
        out = ToolDelta()
        if self.call is None:
            out.content += self._content(buf)
        else:
            self._on_call(out, self._count(self.call.text(buf)))
            if self.call is not None and not self.call.started:
                out.content += self._content(self.call.raw)  # cut off before its name was complete
            self.call = None
        if not self.n_calls:
            out.content += self._ws
        self._ws = ""
        return out


def parse_tool_calls(text: str, tools: dict[str, Any]) -> tuple[str, list[ParsedCall]]:
    """A whole answer as (content, calls): the text cut at every tag at once, through the same
    per-call machine as the stream."""
    asm = _Assembler()
    call: _Call | None = None
    n = 0
    pos = call_at = 0  # where the piece / the current call begins
    for i, piece in enumerate(_SPLIT.split(text)):
        is_tag = i % 2 == 1
        pos += len(piece)
        if call is None:
            if is_tag and piece == CALL_START:
                call, call_at = _Call(n, tools), pos - len(piece)
            else:
                asm.content.append(piece)
            continue
        deltas = call.tag(piece) if is_tag and piece != CALL_START else call.text(piece)
        asm.add(ToolDelta(calls=deltas))
        if call.started and n == call.index:
            asm.calls[call.index].start = call_at
            n += 1
        if call.phase == "closed":
            asm.calls[call.index].complete = True
            call = None
    if call is not None and not call.started:
        asm.content.append(call.raw)
    content = "".join(asm.content)
    calls = [asm.calls[k] for k in sorted(asm.calls)]
    return (content.rstrip() if calls else content), calls
