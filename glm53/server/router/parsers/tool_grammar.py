"""`tool_choice` "required" or a named function, enforced while generating: a Lark grammar
(llguidance, server/grammar.py) of the `glm47` call markup that the answer must follow, with each
call's arguments constrained by the function's JSON schema.

The answer is one call of the named function, or (required) one call of any listed function, or
several back to back when parallel calls are allowed:

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>…</tool_call>

The markers are GLM's single tokens (llguidance's `<[id]>`), so the grammar needs each of them to
be one token; otherwise there is no grammar and the choice is not enforced.

Arguments follow the function's `parameters` schema, so that the `arguments` the parser builds
(tool_calls.py, values typed by arguments.py) always validate against it:
- the keys are the schema's properties, in the schema's order, each at most once; the required
  ones always (a required key the schema does not describe comes after them, with any value);
- a value the parser keeps as text (a property typed only `string`) is raw text that meets the
  string's `enum`/`const`, `minLength`/`maxLength` and `pattern`; any text when it has none
  (never the characters of `</arg_value>` or `</tool_call>`, which would end it for the parser);
- a value typed without `string` (number, integer, boolean, null, object, array, `$ref`s to
  them) is JSON under that property's schema (llguidance's `%json`, compact as structured
  output's JSON), which the parser reads back as that JSON value;
- a value of mixed types (`["string", "null"]`, `anyOf` a string or a number, ...) is either
  JSON of its non-string types or raw text that cannot be read as such JSON (the parser keeps it
  as a string);
- a schema that lists no `properties` at all allows any keys with any values.
Not enforced: string `format`s, and keywords across keys (`dependentRequired`, `minProperties`,
`if`/`then`, ...).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from glm53.server.grammar import JSON_OPTIONS
from glm53.server.router.parsers.arguments import _resolve, argument_types, schema_types
from glm53.server.router.parsers.tool_calls import CALL_END, CALL_START, KEY_END, KEY_START, VAL_END, VAL_START

ANY = r"(.|\n)"
# Text a raw value may not contain: the parser would end the value (or the call) there.
NO_END = r"~/" + ANY + r"*<\/(arg_value|tool_call)>" + ANY + "*/"
# Raw text the parser would read as a non-string value (arguments.convert_value: JSON, then a
# Python literal): a number, list, object or tuple start, leading blanks, or a keyword.
LOOKS_TYPED = r"~/[-+.0-9\[{(\s]" + ANY + r"*/ & ~/(true|false|null|True|False|None)/"
_META = {"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
         "$schema", "$id"}


def _literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def looks_typed(s: str) -> bool:
    """Whether raw text would be read as a non-string value (LOOKS_TYPED, in Python)."""
    return bool(re.match(r"[-+.0-9\[{(\s]", s)) or s in ("true", "false", "null", "True", "False", "None")


def _pattern_regex(pattern: str) -> str:
    """A JSON-schema pattern (found anywhere in the text unless anchored) as a whole-text regex."""
    start = pattern.startswith("^")
    body = pattern[1:] if start else pattern
    end = body.endswith("$") and not body.endswith("\\$")
    body = body[:-1] if end else body
    body = re.sub(r"(?<!\\)/", r"\\/", body)
    return ("" if start else ANY + "*") + "(" + body + ")" + ("" if end else ANY + "*")


class _Grammar:
    """Lark rules, named per call and argument."""

    def __init__(self, root: Any, call: int):
        self.root = root if isinstance(root, dict) else {}
        self.call = call
        self.lines: list[str] = []
        self.n = 0

    def _name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.call}_{self.n}"

    def _json(self, schema: Any) -> str:
        doc = dict(schema) if isinstance(schema, dict) else {}
        for k in ("$defs", "definitions"):  # local $refs resolve against the embedded document
            if k in self.root and k not in doc:
                doc[k] = self.root[k]
        doc["x-guidance"] = JSON_OPTIONS  # structured output's compact JSON
        name = self._name("json_")
        self.lines.append(f"{name}: %json {json.dumps(doc, ensure_ascii=False)}")
        return name

    def _terminal(self, *parts: str) -> str:
        name = self._name("TEXT_")
        self.lines.append(f"{name}: " + " & ".join(parts))
        return name

    def _strings(self, schema: Any, typed_ok: bool) -> list[str]:
        """Lark alternatives for raw text that a string-only schema accepts (typed_ok False: only
        text the parser keeps as text). Empty when none can be written."""
        s = _resolve(schema, self.root, frozenset())
        if not isinstance(s, dict):
            return [self._terminal(f"/{ANY}*/", NO_END)] if s is not False else []
        values = [s["const"]] if "const" in s else s.get("enum")
        if isinstance(values, list):
            return [_literal(v) for v in values if isinstance(v, str) and (typed_ok or not looks_typed(v))]
        for key in ("anyOf", "oneOf"):
            branches = s.get(key)
            if isinstance(branches, list):
                out: list[str] = []
                for b in branches:
                    if schema_types(b, self.root) == {"string"}:
                        out += self._strings(b, typed_ok)
                return out
        lo, hi = s.get("minLength"), s.get("maxLength")
        parts = []
        if isinstance(lo, int) or isinstance(hi, int):
            parts.append(f"/{ANY}{{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}}/")
        if isinstance(s.get("pattern"), str):
            parts.append(f"/{_pattern_regex(s['pattern'])}/")
        if not parts:
            parts.append(f"/{ANY}*/")
        parts.append(NO_END)
        if not typed_ok:
            parts.append(LOOKS_TYPED)
        return [self._terminal(*parts)]

    def _without_strings(self, schema: Any) -> Any:
        """The part of a mixed-type schema that is not a string (None if there is none)."""
        s = _resolve(schema, self.root, frozenset())
        if not isinstance(s, dict):
            return None
        if "const" in s:
            return None if isinstance(s["const"], str) else s
        if isinstance(s.get("enum"), list):
            kept = [v for v in s["enum"] if not isinstance(v, str)]
            return {**s, "enum": kept} if kept else None
        for key in ("anyOf", "oneOf"):
            branches = s.get(key)
            if isinstance(branches, list):
                kept = [b for b in (self._without_strings(b) if schema_types(b, self.root) != {"string"} else None
                                    for b in branches) if b is not None]
                return {**s, key: kept} if kept else None
        t = s.get("type")
        if isinstance(t, list):
            kept = [x for x in t if x != "string"]
            return {**s, "type": kept} if kept else None
        return None if t == "string" else s

    def value(self, schema: Any, types: set[str] | None) -> str:
        """The rule of one argument's value."""
        name = self._name("value_")
        s = _resolve(schema, self.root, frozenset())
        if types == {"string"}:
            alts = self._strings(schema, True) or [self._terminal(f"/{ANY}*/", NO_END)]
        elif types is None and (not isinstance(s, dict) or not set(s) - _META):
            alts = [self._terminal(f"/{ANY}*/", NO_END)]  # any value: text or JSON, as it reads
        elif types is None or "string" not in types:
            alts = [self._json(schema)]
        else:
            other = self._without_strings(schema)
            alts = ([self._json(other)] if other is not None else []) + self._strings(
                {**s, "type": "string"} if isinstance(s.get("type"), list) else s, False)
            if not alts:
                alts = [self._terminal(f"/{ANY}*/", NO_END, LOOKS_TYPED)]
        self.lines.append(f"{name}: " + " | ".join(alts))
        return name


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
        root = _resolve(params, params, frozenset())
        props = root.get("properties") if isinstance(root, dict) else None
        g = _Grammar(params, i)
        if not isinstance(props, dict):
            # No properties listed: any keys, any values (typed by the parser as they read).
            value = g.value({}, None)
            lines.append(f"call_{i}: {tc} {_literal(name)} arg_{i}* {tce}")
            lines.append(f"arg_{i}: {ks} /[^<]+/ {ke} {vs} {value} {ve}")
        else:
            required = [k for k in (root.get("required") or []) if isinstance(k, str)]
            keys = [k for k in props if props[k] is not False] + [k for k in dict.fromkeys(required)
                                                                 if k not in props]
            parts = []
            for j, key in enumerate(keys):
                value = g.value(props.get(key, {}), argument_types(params, key))
                lines.append(f"arg_{i}_{j}: {ks} {_literal(key)} {ke} {vs} {value} {ve}")
                parts.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
            lines.append(" ".join([f"call_{i}:", tc, _literal(name), *parts, tce]))
        lines += g.lines
    return "\n".join(lines) + "\n"
