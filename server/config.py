"""The YAML cluster config: where the router and every prefill/decode instance run, and how.

One file describes the whole deployment (README, "The cluster config"). It is validated completely
before any process starts: an unknown key, a wrong type or an impossible topology raises
`ConfigError` whose message starts with the file and the key path, e.g.

    configs/local.yaml: decode[0].pp: decode instances run one pipeline stage (pp: 1); got 2

Layout (every key optional except the pools):

    model:     {path, served_model_name, context_length, chat_template}
    router:    {host, port, result_port, advertise_host, policy, ...}
    transfer:  {backend, bootstrap_timeout_s, transfer_timeout_s}
    speculative: {algorithm, draft_model_path, num_draft_tokens, draft_kv_transfer}
    defaults:  any instance key below except name/host/port/bootstrap_port
    prefill:   [ {name, host, port, bootstrap_port, devices, tp, pp, <engine knobs>}, ... ]
    decode:    [ ... same, without bootstrap_port ... ]

Each instance inherits `defaults` and overrides it key by key; `InstanceConfig` is the merged,
validated result that an instance process receives.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from glm53.server.config_values import ConfigError, check_keys, check_value, type_name

# Names `up` materializes on first use (server/embedded_model.py): the trained tiny GLM-5, its
# DFlash draft, and a random-weight tiny GLM-5 for tests.
EMBEDDED_MODEL = "embedded:tiny-glm5"
EMBEDDED_RANDOM = "embedded:tiny-glm5-random"
EMBEDDED_DRAFT = "embedded:tiny-glm5-dflash"
PAIRING_POLICIES = ("round_robin", "least_loaded", "random")
# Backends the transport layer implements.
TRANSFER_BACKENDS = ("nixl",)
ROLES = ("prefill", "decode")


# --------------------------------------------------------------------------------------------
# Dataclasses (what processes receive)
# --------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    # A local model directory, or EMBEDDED_MODEL for the tiny GLM-5 created on first use.
    path: str = EMBEDDED_MODEL
    # Names clients may send as `model`; the first one is reported by /v1/models. Empty: the
    # directory's name. Any other name gets a 404.
    served_model_name: list[str] = field(default_factory=list)
    # Maximum prompt + completion tokens; None = config.json's max_position_embeddings.
    context_length: int | None = None
    # A .jinja file overriding the model directory's chat template.
    chat_template: str | None = None


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    # ZMQ PULL socket the router binds for events from instances (protocol.py).
    result_port: int = 30001
    # Host instances use to reach result_port; None = `host`, or 127.0.0.1 when host is 0.0.0.0.
    advertise_host: str | None = None
    policy: Literal["round_robin", "least_loaded", "random"] = "least_loaded"
    # Requests in flight across the cluster beyond which the router answers 503.
    max_running_requests: int = 1024
    health_check_interval_s: float = 2.0
    # An instance that has not answered a ping for this long is unhealthy; its rooms fail.
    health_timeout_s: float = 10.0
    # A room with no event for this long fails with an error event (then [DONE]) and is
    # aborted on both instances. None: transfer.bootstrap_timeout_s + transfer_timeout_s before
    # the first token, transfer.transfer_timeout_s between later events.
    first_token_timeout_s: float | None = None
    # Before the first token, a room whose prefill fails (error event or dead instance) is
    # resubmitted on another prefill instance this many times.
    max_retries: int = 1
    stream_idle_timeout_s: float | None = None
    # Request bodies larger than this get 413 before they are parsed. A prompt that fills a
    # 200K-token context is ~1.4 MB as token ids and ~1 MB as text, so 4 MiB leaves ~3x
    # headroom. JSON parsing and validation hold the interpreter lock wherever they run, so
    # this also bounds the one stall a body can cause the event loop (measured on a 2-core VM
    # at 4 MiB: ~0.3 s for 2M one-digit token ids, ~0.8 s for 125K one-word chat messages).
    max_request_bytes: int = 4 * 1024 * 1024
    # Threads that parse bodies, render chat templates and (de)tokenize, off the event loop.
    tokenizer_pool_size: int = 4
    # Seconds `up` waits for every process to report ready.
    startup_timeout_s: float = 600.0
    # `up` restarts a process that crashes (not one that stops cleanly), after
    # restart_backoff_s doubled per restart in the window (at most 60 s), and gives up on it
    # after max_restarts restarts within restart_window_s.
    max_restarts: int = 5
    restart_window_s: float = 300.0
    restart_backoff_s: float = 1.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Chat output parsers (SGLang's names; server/router/parsers): `<think>` text as
    # reasoning_content, `<tool_call>` markup as tool_calls. None: the text as generated.
    reasoning_parser: Literal["glm45"] | None = None
    tool_call_parser: Literal["glm47"] | None = None

    @property
    def result_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def result_address(self) -> str:
        return f"tcp://{self.result_host}:{self.result_port}"


@dataclass
class TransferConfig:
    backend: Literal["nixl"] = "nixl"
    # Bounded waits (docs/ARCHITECTURE.md, "Transfer lifecycle"): a peer that does not bootstrap
    # or finish a transfer within these fails its rooms on both sides.
    bootstrap_timeout_s: float = 60.0
    transfer_timeout_s: float = 120.0


@dataclass
class SpeculativeConfig:
    """DFlash speculative decoding, for every instance (SGLang's flag names)."""

    algorithm: Literal["none", "DFLASH"] = "none"
    draft_model_path: str | None = None  # a DFlash draft directory (published layout)
    # Tokens a verify step checks, the bonus slot included; None = the draft's block size.
    num_draft_tokens: int | None = None
    # Prefill sends the draft's context KV of the prompt with the target KV. Off, decode drafts
    # only from the context it builds after the handoff (fewer accepted tokens on the first
    # steps, fewer bytes moved).
    draft_kv_transfer: bool = True

    @property
    def enabled(self) -> bool:
        return self.algorithm == "DFLASH"


@dataclass
class EngineConfig:
    """Per-instance engine knobs; `defaults` and instance entries may set any of them."""

    device: Literal["cpu", "cuda"] = "cpu"
    # Model weights dtype at run time; "auto" = the checkpoint's.
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    # "auto" = the model dtype; "fp8_e4m3" = the FP8 KV layouts (656 B/token latent rows for GLM-5,
    # 132 B/token indexer keys); prefill and decode instances must agree on it.
    kv_cache_dtype: Literal["auto", "bfloat16", "float32", "fp8_e4m3"] = "auto"
    page_size: int = 64
    max_running_requests: int = 64
    chunked_prefill_size: int = 8192
    # KV capacity: num_pages, else max_total_tokens, else (GPU) what mem_fraction_static of the
    # device leaves after the weights, else (CPU) 64K tokens.
    num_pages: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    # Decode sends a token event every `stream_interval` steps (1 = every token).
    stream_interval: int = 1
    # Port for torch.distributed rendezvous among an instance's ranks (TP/PP); None = automatic.
    dist_init_port: int | None = None
    # Print SGLang-style "Prefill batch, ..." / "Decode batch, ..." lines every N seconds.
    log_interval_s: float = 10.0
    # CUDA graphs of the decode step (decode instances on CUDA, tp 1, pp 1; with a DFlash draft, of
    # its propose + verify step), captured at start-up for batch sizes 1, 2, 4, ... up to
    # cuda_graph_max_bs (SGLang's --cuda-graph-max-bs); larger batches run eagerly.
    # disable_cuda_graph: never capture (SGLang's --disable-cuda-graph).
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 64
    # Decode instances with tp 1 and pp 1 launch plain greedy steps one ahead of reading their
    # tokens back (engine/overlap.py); disable_overlap_schedule runs every step synchronously
    # (SGLang's --disable-overlap-schedule).
    disable_overlap_schedule: bool = False
    # Prefill instances keep the full KV pages of earlier prompts and reuse them for a prompt that
    # starts with the same tokens (engine/prefix_cache.py); disable_radix_cache turns that off
    # (SGLang's --disable-radix-cache; vLLM's --no-enable-prefix-caching).
    disable_radix_cache: bool = False


@dataclass
class InstanceConfig:
    """One prefill or decode instance, with `defaults` merged in."""

    name: str
    role: Literal["prefill", "decode"]
    host: str
    # ZMQ PULL socket the instance binds for router messages (protocol.py).
    port: int
    # Prefill only: where its transfer bootstrap server listens (decode instances reach it there).
    bootstrap_port: int | None = None
    # GPU ids (device "cuda": exactly tp * pp of them); empty on CPU.
    devices: list[int] = field(default_factory=list)
    tp: int = 1
    pp: int = 1
    # Prefill only: run in the named decode instance's process, on its GPU (one-GPU PD in one
    # process, engine/colocate.py). While that decode instance has requests running, this
    # instance's kernels run on `colocate_sms` SMs (a CUDA green context), so decode steps never
    # wait behind a prefill chunk; otherwise on all of them. On CPU the pair shares the process only.
    colocate: str | None = None
    colocate_sms: int = 48
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"


@dataclass
class ClusterConfig:
    source: str
    model: ModelConfig
    router: RouterConfig
    transfer: TransferConfig
    defaults: EngineConfig
    prefill: list[InstanceConfig]
    decode: list[InstanceConfig]
    name: str = "glm53"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def pool(self, role: str) -> list[InstanceConfig]:
        return self.prefill if role == "prefill" else self.decode

    @property
    def instances(self) -> list[InstanceConfig]:
        return [*self.prefill, *self.decode]

    @property
    def single_host(self) -> bool:
        hosts = {self.router.host, *(i.host for i in self.instances)}
        return all(_is_local_host(h) for h in hosts) or len(hosts) == 1

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (round-trips through `parse_config`)."""
        out: dict[str, Any] = {
            "name": self.name,
            "model": dataclasses.asdict(self.model),
            "router": dataclasses.asdict(self.router),
            "transfer": dataclasses.asdict(self.transfer),
            "speculative": dataclasses.asdict(self.speculative),
            "defaults": dataclasses.asdict(self.defaults),
        }
        for role in ROLES:
            rows = []
            for inst in self.pool(role):
                row = {k: v for k, v in dataclasses.asdict(inst).items() if k not in ("engine", "role")}
                if inst.colocate is None:
                    del row["colocate"], row["colocate_sms"]
                row.update(dataclasses.asdict(inst.engine))
                rows.append(row)
            out[role] = rows
        return out


# --------------------------------------------------------------------------------------------
# Loading and validation
# --------------------------------------------------------------------------------------------

_INSTANCE_ONLY = ("name", "host", "port", "bootstrap_port", "colocate", "colocate_sms")
_PLACEMENT = ("devices", "tp", "pp")
_ALIASES = {"tp_size": "tp", "pp_size": "pp", "max_num_seqs": "max_running_requests", "max_model_len": "context_length"}
_TOP_KEYS = ("name", "model", "router", "transfer", "speculative", "defaults", "prefill", "decode")


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Read and validate a YAML cluster config. `overrides` are command-line values (see
    `apply_overrides`); they win over the file."""
    source = str(path)
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
    # Instances that state their memory share (in their entry or in `defaults`): only those may
    # share a GPU. The dataclass keeps just the value, so this is read off the raw entries.
    sized = {f"{role}[{i}]" for role in ROLES for i, e in enumerate(raw[role])
             if "mem_fraction_static" in e or "mem_fraction_static" in defaults_raw}
    _check_semantics(cfg, sized)
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
            _, role, index, k = parts
            entries = raw.get(role)
            if isinstance(entries, list) and int(index) < len(entries) and isinstance(entries[int(index)], dict):
                entries[int(index)][k] = value
        else:
            node = raw
            for p in parts[:-1]:
                if not isinstance(node.get(p), dict):
                    node[p] = {}
                node = node[p]
            node[parts[-1]] = value
    return raw


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
    for k in ("host", "port", "bootstrap_port") if role == "prefill" else ("host", "port"):
        if k not in entry:
            raise ConfigError(source, f"{path}.{k}", "required key is missing")
    for k in ("colocate", "colocate_sms"):
        if role == "decode" and k in entry:
            raise ConfigError(source, f"{path}.{k}", "set on the prefill instance that shares this decode "
                              "instance's process (prefill[i].colocate: <this decode's name>)")
    if role == "decode" and entry.get("bootstrap_port") is not None:
        raise ConfigError(source, f"{path}.bootstrap_port", "decode instances run no bootstrap server "
                          "(they connect to each prefill instance's); remove this key")
    merged = {**{k: v for k, v in defaults_raw.items() if k in engine_keys}, **{k: v for k, v in entry.items() if k in engine_keys}}
    engine = _build(EngineConfig, merged, path, source)
    placement = {k: entry.get(k, defaults_raw.get(k)) for k in _PLACEMENT}
    fields = {
        "name": entry.get("name", f"{role[0]}{index}"),
        "role": role,
        "host": entry["host"],
        "port": entry["port"],
        "bootstrap_port": entry.get("bootstrap_port"),
        **{k: entry[k] for k in ("colocate", "colocate_sms") if k in entry},
        **{k: v for k, v in placement.items() if v is not None},
    }
    inst = _build(InstanceConfig, fields, path, source, skip=("engine",))
    inst.engine = engine
    return inst


# Instances on one GPU (one-GPU PD: prefill and decode side by side) must each set
# mem_fraction_static, and the fractions must leave the driver and the allocators some room.
MAX_SHARED_MEM_FRACTION = 0.95


def _check_semantics(cfg: ClusterConfig, sized: set[str] | frozenset[str] = frozenset()) -> None:
    """`sized`: the key paths ("decode[0]") of instances that set mem_fraction_static explicitly."""
    src = cfg.source

    def err(key: str, msg: str) -> ConfigError:
        return ConfigError(src, key, msg)

    # Value ranges.
    for name, f in (("router.port", cfg.router.port), ("router.result_port", cfg.router.result_port)):
        _check_port(f, name, src)
    if cfg.router.health_check_interval_s <= 0:
        raise err("router.health_check_interval_s", f"must be > 0, got {cfg.router.health_check_interval_s}")
    if cfg.router.health_timeout_s <= cfg.router.health_check_interval_s:
        raise err("router.health_timeout_s", "must be larger than router.health_check_interval_s "
                  f"({cfg.router.health_timeout_s} <= {cfg.router.health_check_interval_s})")
    if cfg.router.max_running_requests < 1:
        raise err("router.max_running_requests", f"must be >= 1, got {cfg.router.max_running_requests}")
    for k in ("first_token_timeout_s", "stream_idle_timeout_s"):
        v = getattr(cfg.router, k)
        if v is not None and v <= 0:
            raise err(f"router.{k}", f"must be > 0, got {v}")
    if cfg.router.max_retries < 0:
        raise err("router.max_retries", f"must be >= 0, got {cfg.router.max_retries}")
    if cfg.router.startup_timeout_s <= 0:
        raise err("router.startup_timeout_s", f"must be > 0, got {cfg.router.startup_timeout_s}")
    for k, low in (("max_request_bytes", 1024), ("tokenizer_pool_size", 1), ("max_restarts", 0)):
        if getattr(cfg.router, k) < low:
            raise err(f"router.{k}", f"must be >= {low}, got {getattr(cfg.router, k)}")
    for k in ("restart_window_s", "restart_backoff_s"):
        if getattr(cfg.router, k) <= 0:
            raise err(f"router.{k}", f"must be > 0, got {getattr(cfg.router, k)}")
    for k in ("bootstrap_timeout_s", "transfer_timeout_s"):
        if getattr(cfg.transfer, k) <= 0:
            raise err(f"transfer.{k}", f"must be > 0, got {getattr(cfg.transfer, k)}")
    spec = cfg.speculative
    if spec.enabled and not spec.draft_model_path:
        raise err("speculative.draft_model_path", "DFLASH needs a draft model directory")
    if spec.num_draft_tokens is not None and spec.num_draft_tokens < 2:
        raise err("speculative.num_draft_tokens", f"must be >= 2 (the bonus slot and a draft), got "
                  f"{spec.num_draft_tokens}")
    if cfg.model.context_length is not None and cfg.model.context_length < 2:
        raise err("model.context_length", f"must be >= 2, got {cfg.model.context_length}")
    if not cfg.model.path:
        raise err("model.path", "must name a model directory (or 'embedded:tiny-glm5')")
    if cfg.model.path.startswith("embedded:") and cfg.model.path not in (EMBEDDED_MODEL, EMBEDDED_RANDOM):
        raise err("model.path", f"unknown embedded model {cfg.model.path!r}; there are {EMBEDDED_MODEL!r} and "
                  f"{EMBEDDED_RANDOM!r}")
    draft = spec.draft_model_path or ""
    if draft.startswith("embedded:") and draft != EMBEDDED_DRAFT:
        raise err("speculative.draft_model_path", f"unknown embedded draft {draft!r}; the only one is {EMBEDDED_DRAFT!r}")
    if draft == EMBEDDED_DRAFT and cfg.model.path != EMBEDDED_MODEL:
        raise err("speculative.draft_model_path", f"{EMBEDDED_DRAFT!r} is the draft of {EMBEDDED_MODEL!r}, "
                  f"not of {cfg.model.path!r}")
    _check_engine(cfg.defaults, "defaults", src)

    names: dict[str, str] = {}
    ports: dict[tuple[str, int], str] = {}
    router_host = _canonical_host(cfg.router.host)
    ports[(router_host, cfg.router.port)] = "router.port"
    if (router_host, cfg.router.result_port) in ports:
        raise err("router.result_port", f"port {cfg.router.result_port} is already used by router.port")
    ports[(router_host, cfg.router.result_port)] = "router.result_port"
    devices: dict[tuple[str, int], list[tuple[str, InstanceConfig]]] = {}
    for role in ROLES:
        for i, inst in enumerate(cfg.pool(role)):
            path = f"{role}[{i}]"
            if inst.name in names:
                raise err(f"{path}.name", f"duplicate instance name {inst.name!r} (also {names[inst.name]})")
            names[inst.name] = path
            if not inst.host:
                raise err(f"{path}.host", "must not be empty")
            dist_port = inst.engine.dist_init_port
            if dist_port is not None and inst.tp * inst.pp == 1:
                raise err(f"{path}.dist_init_port", "only used by instances with several ranks (tp/pp > 1)")
            for k in ("port", "bootstrap_port", "dist_init_port"):
                port = getattr(inst.engine if k == "dist_init_port" else inst, k)
                if port is None:  # decode: no bootstrap server; automatic rendezvous port
                    continue
                _check_port(port, f"{path}.{k}", src)
                slot = (_canonical_host(inst.host), port)
                clash = ports.get(slot)
                if clash:
                    raise err(f"{path}.{k}", f"port {port} on host {inst.host} is already used by {clash}")
                ports[slot] = f"{path}.{k}"
            if inst.tp < 1:
                raise err(f"{path}.tp", f"must be >= 1, got {inst.tp}")
            if inst.pp < 1:
                raise err(f"{path}.pp", f"must be >= 1, got {inst.pp}")
            if inst.pp > 1 and role == "decode":
                raise err(f"{path}.pp", f"decode instances run one pipeline stage (pp: 1); got {inst.pp}")
            _check_engine(inst.engine, path, src)
            if inst.engine.device == "cpu":
                if inst.devices:
                    raise err(f"{path}.devices", f"device is 'cpu', so devices must be empty; got {inst.devices}")
            else:
                need = inst.tp * inst.pp
                if len(inst.devices) != need:
                    raise err(f"{path}.devices", f"needs exactly tp * pp = {need} GPU ids, got {len(inst.devices)} "
                              f"({inst.devices})")
                if len(set(inst.devices)) != len(inst.devices):
                    raise err(f"{path}.devices", f"lists a GPU twice: {inst.devices}")
                for d in inst.devices:
                    if d < 0:
                        raise err(f"{path}.devices", f"GPU ids must be >= 0, got {d}")
                    slot = (_canonical_host(inst.host), d)
                    users = devices.setdefault(slot, [])
                    unsized = [p for p, _ in users + [(path, inst)] if p not in sized]
                    if users and unsized:
                        keys = " and ".join(f"{p}.mem_fraction_static" for p, _ in users + [(path, inst)])
                        raise err(f"{path}.devices", f"GPU {d} on host {inst.host} is already used by "
                                  f"{', '.join(p for p, _ in users)}; instances may share a GPU only when each "
                                  f"sets mem_fraction_static (not set: {', '.join(unsized)}) and they sum to at "
                                  f"most {MAX_SHARED_MEM_FRACTION}: set {keys}")
                    users.append((path, inst))
                    fractions = [u.engine.mem_fraction_static for _, u in users]
                    if sum(fractions) > MAX_SHARED_MEM_FRACTION + 1e-9:
                        raise err(f"{path}.devices", f"GPU {d} on host {inst.host} is shared with "
                                  f"{', '.join(p for p, _ in users[:-1])}; their mem_fraction_static must be set "
                                  f"and sum to at most {MAX_SHARED_MEM_FRACTION} "
                                  f"({' + '.join(f'{p}.mem_fraction_static {f:g}' for (p, _), f in zip(users, fractions))}"
                                  f" = {sum(fractions):g})")
    _check_colocation(cfg)
    # Both sides of a transfer must agree on the page layout.
    first = cfg.prefill[0]
    for role in ROLES:
        for i, inst in enumerate(cfg.pool(role)):
            for k in ("page_size", "kv_cache_dtype"):
                if getattr(inst.engine, k) != getattr(first.engine, k):
                    raise err(f"{role}[{i}].{k}", f"must equal prefill[0].{k} ({getattr(first.engine, k)!r}) "
                              f"so KV pages can move between instances; got {getattr(inst.engine, k)!r}")


def _check_colocation(cfg: ClusterConfig) -> None:
    """A colocated pair is one process on one GPU: both single-rank CUDA instances on the same
    host and GPU, the decode instance shared by one prefill instance at most."""
    decodes = {d.name: d for d in cfg.decode}
    taken: dict[str, str] = {}
    for i, p in enumerate(cfg.prefill):
        if p.colocate is None:
            continue
        key = f"prefill[{i}].colocate"
        d = decodes.get(p.colocate)
        if d is None:
            raise ConfigError(cfg.source, key, f"no decode instance named {p.colocate!r} "
                              f"(have: {', '.join(decodes) or 'none'})")
        if p.colocate in taken:
            raise ConfigError(cfg.source, key, f"decode instance {p.colocate!r} already shares its process "
                              f"with {taken[p.colocate]}")
        taken[p.colocate] = key.rsplit(".", 1)[0]
        if p.engine.device != d.engine.device:
            raise ConfigError(cfg.source, key, f"colocated instances share one process and device: prefill "
                              f"device {p.engine.device!r}, decode {d.name} device {d.engine.device!r}")
        if (p.tp, p.pp, d.tp) != (1, 1, 1):
            raise ConfigError(cfg.source, key, f"colocated instances run one rank each (tp 1, pp 1); got "
                              f"prefill tp {p.tp} pp {p.pp}, decode tp {d.tp}")
        if _canonical_host(p.host) != _canonical_host(d.host) or p.devices != d.devices:
            raise ConfigError(cfg.source, key, f"colocated instances share one process and GPU: prefill on "
                              f"{p.host} GPU {p.devices}, decode {d.name} on {d.host} GPU {d.devices}")
        if p.colocate_sms < 1:
            raise ConfigError(cfg.source, f"prefill[{i}].colocate_sms", f"must be >= 1, got {p.colocate_sms}")


def _check_engine(e: EngineConfig, path: str, src: str) -> None:
    for k in ("page_size", "max_running_requests", "chunked_prefill_size", "stream_interval", "cuda_graph_max_bs"):
        if getattr(e, k) < 1:
            raise ConfigError(src, f"{path}.{k}", f"must be >= 1, got {getattr(e, k)}")
    for k in ("num_pages", "max_total_tokens"):
        v = getattr(e, k)
        if v is not None and v < 1:
            raise ConfigError(src, f"{path}.{k}", f"must be >= 1, got {v}")
    if not 0 < e.mem_fraction_static <= 1:
        raise ConfigError(src, f"{path}.mem_fraction_static", f"must be in (0, 1], got {e.mem_fraction_static}")
    # The target KV cache holds the model dtype or the FP8 layouts (kernels/latent_cache_fp8,
    # index_cache_fp8); a 16/32-bit cache in another dtype than the model's is not built.
    if e.kv_cache_dtype not in ("auto", "fp8_e4m3", e.dtype):
        raise ConfigError(src, f"{path}.kv_cache_dtype", f"must be 'auto', 'fp8_e4m3' or the model dtype "
                          f"({e.dtype!r}); got {e.kv_cache_dtype!r}")
    if e.log_interval_s <= 0:
        raise ConfigError(src, f"{path}.log_interval_s", f"must be > 0, got {e.log_interval_s}")


def _check_port(port: int, key: str, src: str) -> None:
    if not 1 <= port <= 65535:
        raise ConfigError(src, key, f"must be a TCP port in 1..65535, got {port}")


def _is_local_host(h: str) -> bool:
    return h in ("127.0.0.1", "localhost", "0.0.0.0", "::1", "::", "")


def _canonical_host(h: str) -> str:
    # Loopback names and the wildcard address share one port space on a single host.
    return "*" if _is_local_host(h) else h


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
