"""The config's semantic checks (`parse_config` runs them once every key has parsed): value
ranges, the topology (names, ports and GPUs used once, or GPUs shared with memory shares that
fit), colocated pairs, and what prefill and decode must agree on. Each failure is a
`ConfigError` naming the file and the key."""

from __future__ import annotations

from typing import TYPE_CHECKING

from glm53.server import nodes as nodes_lib
from glm53.server.config_values import (EMBEDDED_DRAFTS, EMBEDDED_MODEL, EMBEDDED_RANDOM, ROLES, ConfigError,
                                        canonical_host)

if TYPE_CHECKING:  # annotations only: config.py imports this module to run the checks
    from glm53.server.config import ClusterConfig, EngineConfig, InstanceConfig

# Instances on one GPU (one-GPU PD: prefill and decode side by side) must each set
# mem_fraction_static, and the fractions must leave the driver and the allocators some room.
MAX_SHARED_MEM_FRACTION = 0.95


def check_semantics(cfg: ClusterConfig, sized: set[str] | frozenset[str] = frozenset()) -> None:
    """`sized`: the key paths ("decode[0]") of instances that set mem_fraction_static explicitly."""
    src = cfg.source

    def err(key: str, msg: str) -> ConfigError:
        return ConfigError(src, key, msg)

    # Value ranges. The HTTP port may be 0: `up` binds a free one and hands it on.
    if cfg.router.port != 0:
        _check_port(cfg.router.port, "router.port", src)
    if cfg.router.result_port is not None:
        _check_port(cfg.router.result_port, "router.result_port", src)
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
    if cfg.router.max_queue_wait_s <= 0:
        raise err("router.max_queue_wait_s", f"must be > 0, got {cfg.router.max_queue_wait_s}")
    if cfg.router.max_queued_requests < 0:
        raise err("router.max_queued_requests", f"must be >= 0 (0: no queue at the router), got "
                  f"{cfg.router.max_queued_requests}")
    if not 0 <= cfg.router.cache_threshold <= 1:
        raise err("router.cache_threshold", f"must be in [0, 1], got {cfg.router.cache_threshold}")
    if cfg.router.balance_abs_threshold < 0:
        raise err("router.balance_abs_threshold", f"must be >= 0, got {cfg.router.balance_abs_threshold}")
    if cfg.router.balance_rel_threshold < 1:
        raise err("router.balance_rel_threshold", f"must be >= 1, got {cfg.router.balance_rel_threshold}")
    if cfg.router.cache_max_pages < 1:
        raise err("router.cache_max_pages", f"must be >= 1, got {cfg.router.cache_max_pages}")
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
        raise err("speculative.draft_model_path", f"{spec.algorithm} needs a draft model directory")
    for key in ("num_draft_tokens", "dspark_block_size"):
        v = getattr(spec, key)
        if v is not None and v < 2:
            raise err(f"speculative.{key}", f"must be >= 2 (the bonus slot and a draft), got {v}")
    # With speculation off, keys of an algorithm are ignored like the draft (`--speculative-algorithm
    # none` on a config written for DSPARK or NEXTN).
    dspark = spec.dspark_block_size is not None or spec.dspark_confidence_threshold != 0
    if dspark and spec.algorithm not in ("none", "DSPARK"):
        key = "dspark_block_size" if spec.dspark_block_size is not None else "dspark_confidence_threshold"
        raise err(f"speculative.{key}", f"applies to algorithm DSPARK, not {spec.algorithm!r}")
    if not 0 <= spec.dspark_confidence_threshold < 1:
        raise err("speculative.dspark_confidence_threshold", f"must lie in [0, 1), got "
                  f"{spec.dspark_confidence_threshold}")
    if (spec.dspark_block_size is not None and spec.num_draft_tokens is not None
            and spec.dspark_block_size != spec.num_draft_tokens):
        raise err("speculative.dspark_block_size", f"{spec.dspark_block_size} disagrees with "
                  f"num_draft_tokens={spec.num_draft_tokens} (both set the verify width; give one)")
    if spec.disable_by_batch_size is not None:
        if spec.disable_by_batch_size < 1:
            raise err("speculative.disable_by_batch_size", f"must be >= 1, got {spec.disable_by_batch_size}")
        if spec.nextn:  # the MTP layer's catch-up rows follow every committed token: not written to skip steps
            raise err("speculative.disable_by_batch_size", f"applies to DFLASH and DSPARK, not {spec.algorithm!r}")
    _check_nextn(spec, err)
    if cfg.model.context_length is not None and cfg.model.context_length < 2:
        raise err("model.context_length", f"must be >= 2, got {cfg.model.context_length}")
    if not cfg.model.path:
        raise err("model.path", "must name a model directory (or 'embedded:tiny-glm5')")
    if cfg.model.path.startswith("embedded:") and cfg.model.path not in (EMBEDDED_MODEL, EMBEDDED_RANDOM):
        raise err("model.path", f"unknown embedded model {cfg.model.path!r}; there are {EMBEDDED_MODEL!r} and "
                  f"{EMBEDDED_RANDOM!r}")
    # With speculation off the draft is neither checked nor loaded (`--speculative-algorithm none`
    # on a config that names one).
    draft = (spec.draft_model_path or "") if spec.enabled else ""
    if draft.startswith("embedded:") and draft not in EMBEDDED_DRAFTS:
        raise err("speculative.draft_model_path", f"unknown embedded draft {draft!r}; there are "
                  + " and ".join(repr(d) for d in EMBEDDED_DRAFTS))
    if draft in EMBEDDED_DRAFTS and cfg.model.path != EMBEDDED_MODEL:
        raise err("speculative.draft_model_path", f"{draft!r} is a draft of {EMBEDDED_MODEL!r}, "
                  f"not of {cfg.model.path!r} (--speculative-algorithm none turns speculation off)")
    _check_engine(cfg.defaults, "defaults", src)

    names: dict[str, str] = {}
    ports: dict[tuple[str, int], str] = {}
    router_host = canonical_host(cfg.router.host)
    ports[(router_host, cfg.router.port)] = "router.port"
    if cfg.router.result_port is not None:
        if (router_host, cfg.router.result_port) in ports:
            raise err("router.result_port", f"port {cfg.router.result_port} is already used by router.port")
        ports[(router_host, cfg.router.result_port)] = "router.result_port"
    _check_pinned_across_hosts(cfg)
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
            if inst.tp < 1:
                raise err(f"{path}.tp", f"must be >= 1, got {inst.tp}")
            if inst.pp < 1:
                raise err(f"{path}.pp", f"must be >= 1, got {inst.pp}")
            if inst.ep < 1 or inst.tp % inst.ep:
                raise err(f"{path}.ep", f"must divide tp ({inst.tp}): the routed experts are split over ep groups "
                          f"of tp / ep ranks; got {inst.ep}")
            dist_host = _check_nodes(cfg, inst, path)
            for k in ("port", "bootstrap_port", "dist_init_port", "dist_init_addr"):
                host = inst.host
                if k == "dist_init_addr":
                    if inst.dist_init_addr is None:
                        continue
                    host, port = dist_host, inst.rendezvous[1]
                else:
                    port = getattr(inst.engine if k == "dist_init_port" else inst, k)
                if port is None:  # decode: no bootstrap server; automatic rendezvous port
                    continue
                _check_port(port, f"{path}.{k}", src)
                slot = (canonical_host(host), port)
                clash = ports.get(slot)
                if clash:
                    raise err(f"{path}.{k}", f"port {port} on host {host} is already used by {clash}")
                ports[slot] = f"{path}.{k}"
            if inst.pp > 1 and role == "decode":
                raise err(f"{path}.pp", f"decode instances run one pipeline stage (pp: 1); got {inst.pp}")
            _check_engine(inst.engine, path, src)
            # GPUs per node: the instance's `devices`, or each of its `nodes`' own.
            per_node = inst.tp * inst.pp // len(inst.node_list)
            for n, node in enumerate(inst.node_list):
                key = f"{path}.nodes[{n}].devices" if inst.nodes else f"{path}.devices"
                if inst.engine.device == "cpu":
                    if node.devices:
                        raise err(key, f"device is 'cpu', so devices must be empty; got {node.devices}")
                    continue
                if len(node.devices) != per_node:
                    need = (f"tp * pp / len(nodes) = {inst.tp} * {inst.pp} / {len(inst.nodes)} = {per_node}"
                            if inst.nodes else f"tp * pp = {per_node}")
                    raise err(key, f"needs exactly {need} GPU ids, got {len(node.devices)} ({node.devices})")
                if len(set(node.devices)) != len(node.devices):
                    raise err(key, f"lists a GPU twice: {node.devices}")
                for d in node.devices:
                    if d < 0:
                        raise err(key, f"GPU ids must be >= 0, got {d}")
                    slot = (canonical_host(node.host), d)
                    users = devices.setdefault(slot, [])
                    unsized = [p for p, _ in users + [(path, inst)] if p not in sized]
                    if users and unsized:
                        keys = " and ".join(f"{p}.mem_fraction_static" for p, _ in users + [(path, inst)])
                        raise err(key, f"GPU {d} on host {node.host} is already used by "
                                  f"{', '.join(p for p, _ in users)}; instances may share a GPU only when each "
                                  f"sets mem_fraction_static (not set: {', '.join(unsized)}) and they sum to at "
                                  f"most {MAX_SHARED_MEM_FRACTION}: set {keys}")
                    users.append((path, inst))
                    fractions = [u.engine.mem_fraction_static for _, u in users]
                    if sum(fractions) > MAX_SHARED_MEM_FRACTION + 1e-9:
                        raise err(key, f"GPU {d} on host {node.host} is shared with "
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


def _check_nodes(cfg: ClusterConfig, inst: InstanceConfig, path: str) -> str | None:
    """An instance across nodes (server/nodes.py): the nodes divide its ranks evenly, sit on
    distinct hosts, and several need `dist_init_addr` (the rendezvous every node's ranks dial);
    it replaces dist_init_port. Returns the rendezvous host (None without dist_init_addr)."""
    src = cfg.source
    dist_host = None
    if inst.dist_init_addr is not None:
        if not inst.nodes:
            raise ConfigError(src, f"{path}.dist_init_addr", "only for an instance that lists nodes; an instance "
                              "on one host sets dist_init_port (or nothing: rank 0 binds a port itself)")
        try:
            dist_host, _ = nodes_lib.parse_host_port(inst.dist_init_addr)
        except ValueError as e:
            raise ConfigError(src, f"{path}.dist_init_addr", str(e)) from None
    if not inst.nodes:
        return dist_host
    try:
        nodes_lib.ranks_per_node(inst.tp * inst.pp, len(inst.nodes))
    except ValueError as e:
        raise ConfigError(src, f"{path}.nodes", f"{e} (tp {inst.tp}, pp {inst.pp})") from None
    seen: dict[str, int] = {}
    for k, node in enumerate(inst.nodes):
        if not node.host:
            raise ConfigError(src, f"{path}.nodes[{k}].host", "must not be empty")
        h = canonical_host(node.host)
        if h in seen:
            raise ConfigError(src, f"{path}.nodes[{k}].host", f"{node.host!r} is already node {seen[h]}; each node "
                              "of an instance is another host")
        seen[h] = k
    if len(inst.nodes) > 1:
        if inst.dist_init_addr is None:
            raise ConfigError(src, f"{path}.dist_init_addr", f"required: the instance spans {len(inst.nodes)} nodes, "
                              "and their ranks meet at HOST:PORT on node 0 (e.g. "
                              f"'{inst.nodes[0].host}:29500')")
        if inst.engine.dist_init_port is not None:
            raise ConfigError(src, f"{path}.dist_init_port", "an instance across nodes sets its rendezvous with "
                              "dist_init_addr (HOST:PORT); remove this key")
        if inst.colocate is not None:
            raise ConfigError(src, f"{path}.colocate", "a colocated instance runs one rank in its decode "
                              "instance's process; it cannot span nodes")
    return dist_host


def _check_pinned_across_hosts(cfg: ClusterConfig) -> None:
    """An unpinned endpoint is an ipc socket (config.server_namespace), which only processes on
    the same host reach: a config that spans hosts pins every internal port."""
    if cfg.single_host:
        return
    keys = [("router.result_port", cfg.router.result_port)]
    for role in ROLES:
        for i, inst in enumerate(cfg.pool(role)):
            keys.append((f"{role}[{i}].port", inst.port))
            if role == "prefill":
                keys.append((f"{role}[{i}].bootstrap_port", inst.bootstrap_port))
    for key, port in keys:
        if port is None:
            hosts = sorted({cfg.router.host, *(n.host for i in cfg.instances for n in i.node_list)})
            raise ConfigError(cfg.source, key, f"required: this config spans several hosts ({', '.join(hosts)}), and "
                              "an unset port is a local ipc socket that other hosts cannot reach")


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
        if canonical_host(p.host) != canonical_host(d.host) or p.devices != d.devices:
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


def _check_nextn(spec, err) -> None:
    """NEXTN / EAGLE: the target's own MTP layer, topk 1, num_steps + 1 tokens verified."""
    if not spec.nextn:
        for key in ("num_steps", "eagle_topk"):
            if getattr(spec, key) is not None and spec.algorithm != "none":
                raise err(f"speculative.{key}", f"applies to algorithm NEXTN (or EAGLE), not {spec.algorithm!r}")
        return
    if spec.draft_model_path:
        raise err("speculative.draft_model_path", f"{spec.algorithm} drafts with the model's own MTP layer; a "
                  f"separate EAGLE draft model is not supported (leave draft_model_path unset)")
    if spec.eagle_topk is not None and spec.eagle_topk != 1:
        raise err("speculative.eagle_topk", f"only 1 is supported (one chain of proposals), got {spec.eagle_topk}")
    if spec.nextn_steps < 1:
        raise err("speculative.num_steps", f"must be >= 1, got {spec.nextn_steps}")
    if spec.num_draft_tokens is not None and spec.num_draft_tokens != spec.nextn_steps + 1:
        raise err("speculative.num_draft_tokens", f"{spec.num_draft_tokens}: with topk 1 a verify checks "
                  f"num_steps + 1 = {spec.nextn_steps + 1} tokens")
