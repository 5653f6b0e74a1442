"""Tool-call argument values typed by the tool's JSON schema.

GLM writes every argument value as text (`<arg_value>42</arg_value>`); OpenAI's `arguments` is a
JSON object, so each value must become a JSON value. The request's `tools[].function.parameters`
says which: a property typed only `string` stays the exact text; one typed without `string`
(number, integer, boolean, object, array, null) is parsed (JSON, then a Python literal such as
`{'a': 1}` or `True`), falling back to the text when it does not parse; a mixed or unknown type
takes the parsed value only when it is not a string (so `"abc"` stays text and `3` is a number).
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}


def _resolve(schema: Any, root: Any, seen: frozenset[int]) -> Any:
    """Follow a local `$ref` ("#/$defs/x")."""
    ref = schema.get("$ref") if isinstance(schema, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#") or id(schema) in seen:
        return schema
    target = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        try:
            target = target[int(part)] if isinstance(target, list) else target[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    return _resolve(target, root, seen | {id(schema)})


def schema_types(schema: Any, root: Any = None, seen: frozenset[int] = frozenset()) -> set[str] | None:
    """The JSON types a schema allows, or None when it does not say."""
    root = schema if root is None else root
    schema = _resolve(schema, root, seen)
    if not isinstance(schema, dict) or id(schema) in seen:
        return None
    seen = seen | {id(schema)}
    found: list[set[str]] = []
    t = schema.get("type")
    if isinstance(t, str):
        found.append({t})
    elif isinstance(t, list):
        found.append({x for x in t if isinstance(x, str)})
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if isinstance(values, list) and values:
        found.append({_JSON_TYPES.get(type(v), "string") for v in values})
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            types = [schema_types(b, root, seen) for b in branches]
            if types and all(x is not None for x in types):
                found.append(set().union(*types))
    for b in schema.get("allOf") or []:
        x = schema_types(b, root, seen)
        if x is not None:
            found.append(x)
    if not found:
        return None
    out = set.intersection(*found) if len(found) > 1 else found[0]
    if "number" in out:
        out.add("integer")  # every integer is a number
    return out


def argument_types(parameters: Any, key: str) -> set[str] | None:
    """The types of argument `key` under a function's `parameters` schema."""
    root = _resolve(parameters, parameters, frozenset())
    if not isinstance(root, dict):
        return None
    props = root.get("properties")
    if not isinstance(props, dict) or key not in props:
        return None
    return schema_types(props[key], parameters)


def is_string_only(types: set[str] | None) -> bool:
    return types == {"string"}


def _parse(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None
    try:
        json.dumps(value)  # a tuple or set is no JSON value
    except (TypeError, ValueError):
        return False, None
    return (True, value) if not isinstance(value, (tuple, set, bytes, complex)) else (False, None)


def convert_value(text: str, types: set[str] | None) -> Any:
    """An argument's text as the JSON value its schema types call for."""
    if is_string_only(types):
        return text
    ok, value = _parse(text)
    if not ok or isinstance(value, str):
        return text
    if types is None:
        return value
    kind = _JSON_TYPES.get(type(value), "string")
    if kind == "number" and not math.isfinite(value):
        return text  # NaN/Infinity are no JSON
    if kind == "number" and value.is_integer() and "integer" in types and "number" not in types - {"integer"}:
        return int(value)
    if kind in types or (kind == "integer" and "number" in types):
        return value
    return text
