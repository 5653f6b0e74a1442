"""Reading typed values out of parsed YAML, with errors that name the file and the key path:
unknown keys (with the closest allowed name), and values checked against a dataclass field's
annotation (unions, literals, lists, bool/int/float/str). Also the names and host rules that the
parser (config.py) and the checks across keys (config_checks.py) both use: they live here, below
both, so that config.py can import config_checks.py and not the other way round."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal

# Names `up` materializes on first use (server/embedded_model.py): the trained tiny GLM-5, its
# DFlash and DSpark drafts, and a random-weight tiny GLM-5 for tests.
EMBEDDED_MODEL = "embedded:tiny-glm5"
EMBEDDED_RANDOM = "embedded:tiny-glm5-random"
EMBEDDED_DRAFT = "embedded:tiny-glm5-dflash"
EMBEDDED_DSPARK = "embedded:tiny-glm5-dspark"
EMBEDDED_DRAFTS = (EMBEDDED_DRAFT, EMBEDDED_DSPARK)
ROLES = ("prefill", "decode")


def is_local_host(h: str) -> bool:
    return h in ("127.0.0.1", "localhost", "0.0.0.0", "::1", "::", "")


def canonical_host(h: str) -> str:
    # Loopback names and the wildcard address share one port space on a single host.
    return "*" if is_local_host(h) else h


class ConfigError(ValueError):
    """Invalid cluster config; the message names the file and the key path."""

    def __init__(self, source: str, key: str, message: str):
        self.source, self.key, self.message = source, key, message
        where = f"{source}: {key}: " if key else f"{source}: "
        super().__init__(where + message)


def check_keys(d: dict[str, Any], allowed: tuple[str, ...] | list[str], path: str, source: str) -> None:
    for k in d:
        if not isinstance(k, str) or k not in allowed:
            key = f"{path}.{k}" if path else str(k)
            hint = _close_match(str(k), allowed)
            raise ConfigError(source, key, "unknown key" + (f" (did you mean '{hint}'?)" if hint else "")
                              + f"; allowed here: {', '.join(allowed)}")


def check_value(v: Any, tp: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        errors = []
        for a in rest:
            try:
                return check_value(v, a, key, source)
            except ConfigError as e:
                errors.append(e.message)
        raise ConfigError(source, key, errors[0] if len(rest) == 1 else f"expected {_describe(tp)}, got {v!r}")
    if origin is Literal:
        if v not in args:
            raise ConfigError(source, key, f"must be one of {', '.join(map(repr, args))}; got {v!r}")
        return v
    if origin is list:
        if isinstance(v, (str, int, float)) and args and args[0] is str:
            v = [v]  # a single served name may be written as a scalar
        if not isinstance(v, list):
            raise ConfigError(source, key, f"expected a list, got {type_name(v)}")
        return [check_value(x, args[0], f"{key}[{i}]", source) for i, x in enumerate(v)]
    if tp is bool:
        if not isinstance(v, bool):
            raise ConfigError(source, key, f"expected true/false, got {v!r}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(source, key, f"expected an integer, got {type_name(v)} {v!r}")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(source, key, f"expected a number, got {type_name(v)} {v!r}")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise ConfigError(source, key, f"expected a string, got {type_name(v)} {v!r}")
        return v
    raise TypeError(f"config field {key}: unsupported annotation {tp!r}")  # a bug in this module


def _describe(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return " or ".join(getattr(a, "__name__", str(a)) for a in args)


def type_name(v: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _close_match(k: str, allowed: tuple[str, ...] | list[str]) -> str | None:
    m = difflib.get_close_matches(k, list(allowed), n=1, cutoff=0.75)
    return m[0] if m else None
