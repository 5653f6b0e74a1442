"""Reading a YAML cluster config into the dataclasses of `config.py`, validated completely before
any process starts (`load_config`, `parse_config`; command-line `apply_overrides`): unknown keys,
wrong types and impossible topologies raise `ConfigError` naming the file and the key path."""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from glm53.server.config import (ClusterConfig, EngineConfig, InstanceConfig, ModelConfig, NodeConfig, RouterConfig,
                                 SpeculativeConfig, TransferConfig, server_namespace)
from glm53.server.config_checks import check_semantics
from glm53.server.config_values import ROLES, ConfigError, check_keys, check_value, type_name


_INSTANCE_ONLY = ("name", "host", "port", "bootstrap_port", "colocate", "colocate_sms", "nodes", "dist_init_addr")
_PLACEMENT = ("devices", "tp", "pp", "ep")
_ALIASES = {"tp_size": "tp", "pp_size": "pp", "ep_size": "ep", "max_num_seqs": "max_running_requests", "max_model_len": "context_length"}
_TOP_KEYS = ("name", "model", "router", "transfer", "speculative", "defaults", "prefill", "decode")


def load_config(path: str | Path, overrides: dict[str, Any] | None = None, source: str | None = None) -> ClusterConfig:
    """Read and validate a YAML cluster config. `overrides` are command-line values (see
    `apply_overrides`); they win over the file. `source`: the file errors name (default `path`;
    `up`'s processes read a resolved copy but name the user's file)."""
    source = source or str(path)
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(source, "", f"cannot read the config file ({e.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(source, "", f"not valid YAML: {e}") from None
    if raw is None:
        raw = {}
    return parse_config(raw, source=source, overrides=overrides)


def parse_config(raw: Any, source: str = "<config>", overrides: dict[str, Any] | None = None) -> ClusterConfig:
    if not isinstance(raw, dict):
        raise ConfigError(source, "", f"the top level must be a mapping, got {type_name(raw)}")
    raw = apply_overrides(raw, overrides or {})
    check_keys(raw, _TOP_KEYS, "", source)
    name = check_value(raw.get("name", "glm53"), str, "name", source)
    model = _build(ModelConfig, raw.get("model", {}), "model", source)
    router = _build(RouterConfig, raw.get("router", {}), "router", source)
    transfer = _build(TransferConfig, raw.get("transfer", {}), "transfer", source)
    speculative = _build(SpeculativeConfig, raw.get("speculative", {}), "speculative", source)

    defaults_raw = raw.get("defaults", {})
    if not isinstance(defaults_raw, dict):
        raise ConfigError(source, "defaults", f"expected a mapping, got {type_name(defaults_raw)}")
    defaults_raw = _resolve_aliases(defaults_raw, "defaults", source)
    engine_keys = [f.name for f in dataclasses.fields(EngineConfig)]
    check_keys(defaults_raw, (*engine_keys, *_PLACEMENT), "defaults", source)
    defaults = _build(EngineConfig, {k: v for k, v in defaults_raw.items() if k in engine_keys}, "defaults", source)

    pools: dict[str, list[InstanceConfig]] = {}
    for role in ROLES:
        entries = raw.get(role)
        if entries is None:
            raise ConfigError(source, role, f"missing: list at least one {role} instance")
        if not isinstance(entries, list) or not entries:
            raise ConfigError(source, role, f"expected a non-empty list of instances, got {type_name(entries)}")
        pools[role] = [
            _build_instance(e, role, i, defaults_raw, source) for i, e in enumerate(entries)
        ]

    cfg = ClusterConfig(
        source=source, name=name, model=model, router=router, transfer=transfer, speculative=speculative,
        defaults=defaults, prefill=pools["prefill"], decode=pools["decode"],
    )
    for inst in cfg.instances:
        inst.namespace = server_namespace(router)
    # Instances that state their memory share (in their entry or in `defaults`): only those may
    # share a GPU. The dataclass keeps just the value, so this is read off the raw entries.
    sized = {f"{role}[{i}]" for role in ROLES for i, e in enumerate(raw[role])
             if "mem_fraction_static" in e or "mem_fraction_static" in defaults_raw}
    check_semantics(cfg, sized)
    return cfg


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of `raw` with command-line overrides applied. Keys:

    - "model.path", "router.port", ... (dotted, a section key)
    - "engine.<key>" (an instance/engine key such as page_size, tp): set in `defaults` and in
      every instance entry, so the flag wins over per-instance values too
    - "instance.<role>.<index>.<key>": one instance only (the `prefill`/`decode` subcommands)
    """
    raw = copy.deepcopy(raw)
    for key, value in overrides.items():
        if value is None:
            continue
        parts = key.split(".")
        if parts[0] == "engine":
            raw.setdefault("defaults", {})
            if isinstance(raw["defaults"], dict):
                raw["defaults"][parts[1]] = value
            for role in ROLES:
                for entry in raw.get(role) or []:
                    if isinstance(entry, dict):
                        for alias, canon in _ALIASES.items():
                            if canon == parts[1]:
                                entry.pop(alias, None)
                        entry[parts[1]] = value
        elif parts[0] == "instance":
            _, role, index, k, *node = parts
            entries = raw.get(role)
            if isinstance(entries, list) and int(index) < len(entries) and isinstance(entries[int(index)], dict):
                entry = entries[int(index)]
                if k == "nnodes":
                    _set_nnodes(entry, value)
                elif k == "nodes":  # "instance.<role>.<i>.nodes.<k>.host": one node's key
                    nodes = entry.get("nodes")
                    if isinstance(nodes, list) and int(node[0]) < len(nodes) and isinstance(nodes[int(node[0])], dict):
                        nodes[int(node[0])][node[1]] = value
                else:
                    entry[k] = value
        else:
            node = raw
            for p in parts[:-1]:
                if not isinstance(node.get(p), dict):
                    node[p] = {}
                node = node[p]
            node[parts[-1]] = value
    return raw


def _set_nnodes(entry: dict[str, Any], n: int) -> None:
    """SGLang's --nnodes on an instance entry. An entry that lists `nodes` keeps them (the check
    that their count is n is the CLI's, which names the flag); one that does not gets n nodes on
    its host, which --node-rank K's --host then names for node K. Its `devices` become every
    node's GPU ids, as each SGLang node uses its own GPUs 0..n-1."""
    if "nodes" in entry or n < 1:
        return
    node = {"host": entry.get("host", "")}
    if "devices" in entry:
        node["devices"] = entry.pop("devices")
    entry["nodes"] = [dict(node) for _ in range(n)]


def _resolve_aliases(d: dict[str, Any], path: str, source: str) -> dict[str, Any]:
    out = dict(d)
    for alias, canon in _ALIASES.items():
        if alias in out:
            if canon in out:
                raise ConfigError(source, f"{path}.{alias}", f"both '{alias}' and its alias target '{canon}' are set")
            out[canon] = out.pop(alias)
    return out


def _build_instance(entry: Any, role: str, index: int, defaults_raw: dict[str, Any], source: str) -> InstanceConfig:
    path = f"{role}[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(source, path, f"expected a mapping, got {type_name(entry)}")
    entry = _resolve_aliases(entry, path, source)
    engine_keys = [f.name for f in dataclasses.fields(EngineConfig)]
    check_keys(entry, (*_INSTANCE_ONLY, *_PLACEMENT, *engine_keys), path, source)
    node_list = _build_nodes(entry, path, source)
    if node_list and "host" not in entry:
        entry = {**entry, "host": node_list[0].host}  # node 0 runs the scheduler
    if "host" not in entry:
        raise ConfigError(source, f"{path}.host", "required key is missing")
    for k in ("colocate", "colocate_sms"):
        if role == "decode" and k in entry:
            raise ConfigError(source, f"{path}.{k}", "set on the prefill instance that shares this decode "
                              "instance's process (prefill[i].colocate: <this decode's name>)")
    if role == "decode" and entry.get("bootstrap_port") is not None:
        raise ConfigError(source, f"{path}.bootstrap_port", "decode instances run no bootstrap server "
                          "(they connect to each prefill instance's); remove this key")
    merged = {**{k: v for k, v in defaults_raw.items() if k in engine_keys}, **{k: v for k, v in entry.items() if k in engine_keys}}
    engine = _build(EngineConfig, merged, path, source)
    # With nodes, GPUs are listed per node: none at the instance level, not even from defaults.
    placement = {k: entry.get(k, defaults_raw.get(k)) for k in _PLACEMENT if not (node_list and k == "devices")}
    fields = {
        "name": entry.get("name", f"{role[0]}{index}"),
        "role": role,
        "host": entry["host"],
        "port": entry.get("port"),
        "bootstrap_port": entry.get("bootstrap_port"),
        **{k: entry[k] for k in ("colocate", "colocate_sms", "dist_init_addr") if k in entry},
        **{k: v for k, v in placement.items() if v is not None},
    }
    inst = _build(InstanceConfig, fields, path, source, skip=("engine", "namespace", "nodes"))
    inst.engine = engine
    inst.nodes = node_list
    return inst


def _build_nodes(entry: dict[str, Any], path: str, source: str) -> list[NodeConfig]:
    """An instance's `nodes:` list. With it, node 0 is the instance's host and each node lists
    its own GPUs, so the instance-level `host` (if given) must be node 0's and `devices` is
    refused rather than guessed at."""
    raw = entry.get("nodes")
    if raw is None:
        return []
    if not isinstance(raw, list) or not raw:
        raise ConfigError(source, f"{path}.nodes", f"expected a non-empty list of {{host, devices}}, got "
                          f"{type_name(raw)}")
    out = [_build(NodeConfig, n, f"{path}.nodes[{k}]", source) for k, n in enumerate(raw)]
    if "devices" in entry:
        raise ConfigError(source, f"{path}.devices", "with nodes, each node lists its own GPUs "
                          f"({path}.nodes[k].devices); remove this key")
    if "host" in entry and entry["host"] != out[0].host:
        raise ConfigError(source, f"{path}.host", f"must be node 0's host ({out[0].host!r}: node 0 runs the "
                          f"scheduler and rank 0), got {entry['host']!r}; or leave it out")
    return out


# --------------------------------------------------------------------------------------------
# Dataclass building with key-path errors (value checks: config_values.py)
# --------------------------------------------------------------------------------------------


def _build(cls: type, d: Any, path: str, source: str, skip: tuple[str, ...] = ()) -> Any:
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(source, path, f"expected a mapping, got {type_name(d)}")
    d = _resolve_aliases(d, path, source)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    check_keys(d, tuple(fields), path, source)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for k, v in d.items():
        kwargs[k] = check_value(v, hints[k], f"{path}.{k}" if path else k, source)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(source, f"{path}.{missing[0]}", "required key is missing")
    return cls(**kwargs)
