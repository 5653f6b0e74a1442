"""`tool_choice` "required" or a named function, enforced while generating: a Lark grammar
(llguidance, server/grammar.py) of the `glm47` call markup that the answer must follow.

The answer is one call of the named function, or (required) one call of any listed function, or
several back to back when parallel calls are allowed:

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>

NAME is one of the functions, KEY one of that function's schema properties (any name when its
schema lists none), VALUE any text up to `</arg_value>`. The markers are GLM's single tokens
(llguidance's `<[id]>`), so the grammar needs each of them to be one token; otherwise there is
no grammar and the choice is not enforced. Values are not typed here: the parser types them
from the schema afterwards (arguments.py).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from glm53.server.router.parsers.tool_calls import CALL_END, CALL_START, KEY_END, KEY_START, VAL_END, VAL_START


def _literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def tool_call_lark(token_id: Callable[[str], int | None], tools: dict[str, Any], only: str | None,
                   parallel: bool) -> str | None:
    ids = [token_id(t) for t in (CALL_START, CALL_END, KEY_START, KEY_END, VAL_START, VAL_END)]
    if any(i is None for i in ids):
        return None
    tc, tce, ks, ke, vs, ve = (f"<[{i}]>" for i in ids)
    names = [only] if only is not None else list(tools)
    lines = [f"start: call{'+' if parallel and only is None else ''}",
             "call: " + " | ".join(f"call_{i}" for i in range(len(names)))]
    for i, name in enumerate(names):
        params = tools.get(name) or {}
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(props, dict) and not props:
            lines.append(f"call_{i}: {tc} {_literal(name)} {tce}")
            continue
        key = " | ".join(_literal(k) for k in props) if isinstance(props, dict) else "/[^<]+/"
        lines.append(f"call_{i}: {tc} {_literal(name)} arg_{i}* {tce}")
        lines.append(f"arg_{i}: {ks} key_{i} {ke} {vs} value {ve}")
        lines.append(f"key_{i}: {key}")
    # Any text: the markers are special tokens, outside what a text lexeme matches, so the value
    # ends exactly where </arg_value> comes (a lazy `stop=""` lexeme would let eos end it).
    lines.append("value: /(.|\\n)*/")
    return "\n".join(lines) + "\n"
