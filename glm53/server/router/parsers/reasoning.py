"""The `glm45` reasoning parser: GLM's `<think>…</think>` split from the answer.

GLM-4.7/GLM-5 templates open the thinking block in the prompt (`<|assistant|><think>`), so the
output starts inside reasoning and carries only the closing `</think>`; older GLM models emit
the opening `<think>` themselves. Rules (the same for a whole text and for a stream):
- a `<think>` at the very start of the output (after optional whitespace) opens reasoning (and
  is dropped);
- reasoning ends at the first `</think>` (dropped) or at the first `<tool_call>` (kept: it belongs
  to the answer, where the tool-call parser reads it);
- an output that never leaves reasoning is all reasoning (e.g. cut off by max_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_START = "<tool_call>"
_ENDS = (THINK_END, TOOL_START)


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a rendered prompt leaves the assistant turn inside a thinking block."""
    return prompt_tail.rstrip().endswith(THINK_START)


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str, str]:
    """A whole output as (reasoning, answer)."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        in_reasoning, text = True, stripped[len(THINK_START):]
    if not in_reasoning:
        return "", text
    ends = [(text.find(m), m) for m in _ENDS if m in text]
    if not ends:
        return text, ""
    i, marker = min(ends)
    return text[:i], text[i + len(THINK_END):] if marker == THINK_END else text[i:]


def partial_suffix(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of one of `markers` (text
    that must wait for the next delta before it can be classified)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    answer: str = ""


class ReasoningStream:
    """`split_reasoning` over text that arrives in pieces: feed deltas, then `finish()`. Text
    that could be the start of a marker is held until the next delta decides it."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self._at_start = True  # an opening <think> may still come (after whitespace)
        self._done = False  # reasoning is over: everything else is answer
        self._buf = ""

    def feed(self, delta: str) -> ReasoningDelta:
        buf = self._buf + delta
        self._buf = ""
        if self._done:
            return ReasoningDelta(answer=buf)
        if self._at_start:
            head = buf.lstrip()
            if len(head) < len(THINK_START) and THINK_START.startswith(head):
                self._buf = buf  # whitespace or a partial "<think>": undecided
                return ReasoningDelta()
            self._at_start = False
            if head.startswith(THINK_START):
                self.in_reasoning, buf = True, head[len(THINK_START):]
        if not self.in_reasoning:
            self._done = True
            return ReasoningDelta(answer=buf)
        ends = [(buf.find(m), m) for m in _ENDS if m in buf]
        if ends:
            i, marker = min(ends)
            self._done, self.in_reasoning = True, False
            return ReasoningDelta(reasoning=buf[:i],
                                  answer=buf[i + len(THINK_END):] if marker == THINK_END else buf[i:])
        hold = partial_suffix(buf, _ENDS)
        self._buf = buf[len(buf) - hold:] if hold else ""
        return ReasoningDelta(reasoning=buf[:len(buf) - hold])

    def finish(self) -> ReasoningDelta:
        """What is still held, at the end of the output."""
        buf, self._buf = self._buf, ""
        if not buf:
            return ReasoningDelta()
        return ReasoningDelta(reasoning=buf) if self.in_reasoning and not self._done else ReasoningDelta(answer=buf)
