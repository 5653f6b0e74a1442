"""The YAML cluster config: where the router and every prefill/decode instance run, and how.

One file describes the whole deployment (README, "The cluster config"). It is validated completely
before any process starts: an unknown key, a wrong type or an impossible topology raises
`ConfigError` whose message starts with the file and the key path, e.g.

    configs/local.yaml: decode[0].pp: decode instances run one pipeline stage (pp: 1); got 2

Layout (every key optional except the pools):

    model:     {path, served_model_name, context_length, chat_template, skip_tokenizer_init}
    router:    {host, port, result_port, advertise_host, policy, ...}
    transfer:  {backend, bootstrap_timeout_s, transfer_timeout_s}
    speculative: {algorithm, draft_model_path, num_draft_tokens, draft_kv_transfer, dspark_block_size,
                  dspark_confidence_threshold, disable_by_batch_size}
    defaults:  any instance key below except name/host/port/bootstrap_port/nodes/dist_init_addr
    prefill:   [ {name, host, port, bootstrap_port, devices, tp, pp, ep, <engine knobs>}, ... ]
    decode:    [ ... same, without bootstrap_port ... ]

An instance across nodes lists `nodes: [{host, devices}, ...]` (node-rank order; node 0 is its
host) and `dist_init_addr: HOST:PORT` instead of `host` and `devices` (server/nodes.py).

Each instance inherits `defaults` and overrides it key by key; `InstanceConfig` is the merged,
validated result that an instance process receives. This module holds the dataclasses; reading and
validating a file into them is `config_parse.py` (`load_config`, `parse_config`).
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Literal


from glm53.server import nodes as nodes_lib
# The embedded model names and ROLES live in config_values, below this module, config_checks and
# config_parse (which reads a YAML file into these dataclasses); they are still importable from here.
from glm53.server.config_values import (EMBEDDED_DRAFT, EMBEDDED_DSPARK, EMBEDDED_MODEL, EMBEDDED_RANDOM,  # noqa: F401
                                        ROLES, ConfigError, canonical_host, is_local_host)

PAIRING_POLICIES = ("round_robin", "least_loaded", "random")
# Backends the transport layer implements.
TRANSFER_BACKENDS = ("nixl",)


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
    # Serve token ids only, with no tokenizer (SGLang's and vLLM's --skip-tokenizer-init): for a
    # checkpoint without tokenizer.json, or clients that tokenize themselves. Prompts come as token
    # ids (/generate input_ids, /v1/completions prompt), answers carry ids (/generate output_ids)
    # and empty text; text prompts, chat, stop strings, response_format and /tokenize are a 400.
    skip_tokenizer_init: bool = False


@dataclass
class RouterConfig:
    host: str = "127.0.0.1"
    # The HTTP port: the one port every deployment pins. `up --port 0` binds any free one and
    # prints it (the processes it starts get the bound port).
    port: int = 30000
    # ZMQ PULL socket the router binds for events from instances (protocol.py). None (unpinned):
    # an ipc socket named after the HTTP address (`server_namespace`), on one host only.
    result_port: int | None = None
    # Host instances use to reach result_port; None = `host`, or 127.0.0.1 when host is 0.0.0.0.
    advertise_host: str | None = None
    policy: Literal["round_robin", "least_loaded", "random", "cache_aware"] = "least_loaded"
    # cache_aware (router/prefix_routing.py, SGLang's gateway defaults): a prefill instance that
    # likely holds at least this fraction of the prompt as cached prefix gets it, unless the
    # in-flight counts differ by more than balance_abs_threshold and balance_rel_threshold times;
    # the router remembers at most cache_max_pages pages per instance.
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    cache_max_pages: int = 65536
    # Requests in flight across the cluster beyond which the router answers 503.
    max_running_requests: int = 1024
    # The admission queue (router/admission.py): a request waits, first in line at the router
    # while every decode instance holds max_running_requests rooms, then in the instances'
    # queues, at most max_queue_wait_s until both instances admitted it (SGLang waits up to 600 s
    # in its prefill queue); at most max_queued_requests wait at the router. Beyond either bound:
    # 503 with Retry-After. Queueing is never a transfer fault.
    max_queue_wait_s: float = 600.0
    max_queued_requests: int = 1024
    health_check_interval_s: float = 2.0
    # An instance that has not answered a ping for this long is unhealthy; its rooms fail.
    health_timeout_s: float = 10.0
    # A room with no event for this long fails with an error event (then [DONE]) and is
    # aborted on both instances. None: transfer.bootstrap_timeout_s + transfer_timeout_s before
    # the first token, transfer.transfer_timeout_s between later events. Before the first token
    # this counts from both instances' admission: the queue wait before it is max_queue_wait_s's.
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
        """Where instances push their events (the router binds `result_bind_address`)."""
        if self.result_port is None:
            return f"{server_namespace(self)}/router"
        return f"tcp://{self.result_host}:{self.result_port}"

    @property
    def result_bind_address(self) -> str:
        if self.result_port is None:
            return self.result_address
        return f"tcp://{self.host}:{self.result_port}"


def server_namespace(router: RouterConfig) -> str:
    """The prefix of a server's unpinned endpoints: Linux abstract ipc sockets named after the
    router's HTTP address, which only one server on a host can hold. Every process of the server
    derives the same names from the same config; nothing is probed or handed over, a name is
    bound by the process that owns it and kept (a second bind of a held name fails), and a
    restarted process binds its name again, so its peers reconnect as to a pinned port."""
    host = canonical_host(router.host)
    return f"ipc://@glm53-{'local' if host == '*' else host}-{router.port}"


@dataclass
class TransferConfig:
    backend: Literal["nixl"] = "nixl"
    # Bounded waits (docs/ARCHITECTURE.md, "Transfer lifecycle"): a peer that does not bootstrap
    # or finish a transfer within these fails its rooms on both sides.
    bootstrap_timeout_s: float = 60.0
    transfer_timeout_s: float = 120.0


@dataclass
class SpeculativeConfig:
    """DFlash-family speculative decoding (DFLASH or DSPARK), for every instance (SGLang's flag
    names)."""

    algorithm: Literal["none", "DFLASH", "DSPARK", "NEXTN", "EAGLE"] = "none"
    # A DFlash draft directory (published layout); DSPARK: one with the Markov head's tensors.
    draft_model_path: str | None = None
    # Tokens a verify step checks, the bonus slot included; None = the draft's block size.
    num_draft_tokens: int | None = None
    # Prefill sends the draft's context KV of the prompt with the target KV. Off, decode drafts
    # only from the context it builds after the handoff (fewer accepted tokens on the first
    # steps, fewer bytes moved).
    draft_kv_transfer: bool = True
    # DSPARK only: the verify width (as num_draft_tokens; None: the draft's block size) and the
    # confidence below which a block is cut (0: never; the draft needs a confidence head).
    dspark_block_size: int | None = None
    dspark_confidence_threshold: float = 0.0
    # DFLASH / DSPARK: a decode step whose batch holds more requests than this verifies each one's
    # next token alone, with no drafting (vLLM's `disable_by_batch_size`; None: never). The verify
    # still writes the draft's context KV, so the requests draft again once the batch is small.
    disable_by_batch_size: int | None = None
    # NEXTN (alias EAGLE): the checkpoint's own MTP layer drafts num_steps tokens per verify
    # (None: 3), topk 1 only (eagle_topk); num_draft_tokens, if given, must be num_steps + 1.
    num_steps: int | None = None
    eagle_topk: int | None = None

    @property
    def enabled(self) -> bool:
        """A DFlash-family draft model (draft_model_path) is on."""
        return self.algorithm in ("DFLASH", "DSPARK")

    @property
    def nextn(self) -> bool:
        """The target's own MTP layer drafts (NEXTN, or EAGLE with no separate draft)."""
        return self.algorithm in ("NEXTN", "EAGLE")

    @property
    def nextn_steps(self) -> int:
        return self.num_steps if self.num_steps is not None else 3

    @property
    def verify_width(self) -> int | None:
        """Tokens a verify step checks, the bonus slot included (None: the draft's block size)."""
        if self.algorithm == "DSPARK" and self.dspark_block_size is not None:
            return self.dspark_block_size
        if self.nextn:
            return self.nextn_steps + 1
        return self.num_draft_tokens


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
    # Decode instances with tp 1 and pp 1 launch plain steps one ahead of reading their tokens
    # back, and graphed speculative steps of greedy rows one ahead of reading what they accepted
    # (engine/overlap.py); disable_overlap_schedule runs every step synchronously (SGLang's
    # --disable-overlap-schedule).
    disable_overlap_schedule: bool = False
    # Prefill instances keep the full KV pages of earlier prompts and reuse them for a prompt that
    # starts with the same tokens (engine/prefix_cache.py); disable_radix_cache turns that off
    # (SGLang's --disable-radix-cache; vLLM's --no-enable-prefix-caching).
    disable_radix_cache: bool = False


@dataclass
class NodeConfig:
    """One node of an instance that spans nodes (`nodes:`, in node-rank order)."""

    # The node's address: its ranks bind their transfer endpoints here.
    host: str
    # GPU ids on this node (device "cuda": exactly tp * pp / len(nodes) of them); empty on CPU.
    devices: list[int] = field(default_factory=list)


@dataclass
class InstanceConfig:
    """One prefill or decode instance, with `defaults` merged in."""

    name: str
    role: Literal["prefill", "decode"]
    host: str
    # ZMQ PULL socket the instance binds for router messages (protocol.py). None (unpinned): an
    # ipc socket in the server's namespace (`address`), on one host only.
    port: int | None = None
    # Prefill only: where its transfer bootstrap server listens (decode instances reach it
    # there). None: an ipc socket in the server's namespace (`bootstrap_address`).
    bootstrap_port: int | None = None
    # GPU ids (device "cuda": exactly tp * pp of them); empty on CPU.
    devices: list[int] = field(default_factory=list)
    tp: int = 1
    pp: int = 1
    # Expert parallelism inside each stage's tp ranks (dividing tp): the routed experts split into
    # ep contiguous ranges, one per group of tp / ep ranks, tokens moved to them by all-to-all
    # (models/expert_parallel.py). 1: every rank holds every expert at 1/tp of its width.
    ep: int = 1
    # Prefill only: run in the named decode instance's process, on its GPU (one-GPU PD in one
    # process, engine/colocate.py). While that decode instance has requests running, this
    # instance's kernels run on `colocate_sms` SMs (a CUDA green context), so decode steps never
    # wait behind a prefill chunk; otherwise on all of them. On CPU the pair shares the process only.
    colocate: str | None = None
    colocate_sms: int = 48
    # An instance across nodes (server/nodes.py): its pp × tp ranks split evenly over these, in
    # order, stage-major; node 0 is `host` (it runs rank 0 and the scheduler). Each node runs its
    # part under `glm53-serve up --node-rank K`. Empty: every rank on `host`.
    nodes: list[NodeConfig] = field(default_factory=list)
    # HOST:PORT of the ranks' torch.distributed rendezvous (rank 0's store, on node 0); required
    # with several nodes (SGLang's --dist-init-addr).
    dist_init_addr: str | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Not a YAML key: the server's `server_namespace`, set by parse_config, for unpinned endpoints.
    namespace: str = field(default="", repr=False, compare=False)

    @property
    def address(self) -> str:
        """The instance's control endpoint (it binds it; the router and `up` connect)."""
        return f"tcp://{self.host}:{self.port}" if self.port is not None else self._ipc("control")

    @property
    def bootstrap_address(self) -> str | None:
        """Prefill: its transfer bootstrap server (its ranks register there, decode queries it)."""
        if self.role != "prefill":
            return None
        return f"tcp://{self.host}:{self.bootstrap_port}" if self.bootstrap_port is not None else self._ipc("bootstrap")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def node_list(self) -> list[NodeConfig]:
        """The instance's nodes: `nodes`, or one node (`host`, `devices`) without it."""
        return self.nodes or [NodeConfig(self.host, list(self.devices))]

    def node_ranks(self, node: int) -> range:
        """The global ranks node `node` runs (server/nodes.py)."""
        return nodes_lib.node_ranks(self.world_size, len(self.node_list), node)

    def rank_node(self, rank: int) -> NodeConfig:
        return self.node_list[nodes_lib.node_of_rank(self.world_size, len(self.node_list), rank)]

    def rank_device(self, rank: int) -> int | None:
        """Global rank `rank`'s GPU id on its node (None on CPU: no devices listed)."""
        devices = self.rank_node(rank).devices
        per = self.world_size // len(self.node_list)
        return devices[rank % per] if devices else None

    @property
    def rendezvous(self) -> tuple[str, int | None]:
        """Where rank 0's rendezvous store listens and the other ranks find it."""
        if self.dist_init_addr:
            return nodes_lib.parse_host_port(self.dist_init_addr)
        return self.host, self.engine.dist_init_port

    def _ipc(self, what: str) -> str:
        if not self.namespace:
            raise ValueError(f"{self.role} instance {self.name}: no {what} port is set and no server namespace is "
                             "known (an InstanceConfig not made by parse_config)")
        return f"{self.namespace}/{self.role}/{urllib.parse.quote(self.name, safe='')}/{what}"


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

    def bootstrap_address_of(self, peer: Any) -> str:
        """The bootstrap address of the prefill instance a request names (`protocol.PeerInfo`):
        this config's, which knows unpinned endpoints too; else the peer's host and port."""
        inst = next((p for p in self.prefill if p.name == peer.name), None)
        return inst.bootstrap_address if inst is not None else f"tcp://{peer.host}:{peer.bootstrap_port}"

    def colocated_prefill(self, decode: InstanceConfig) -> InstanceConfig | None:
        """The prefill instance that runs in `decode`'s process and GPU (`colocate: <its name>`), if any."""
        return next((p for p in self.prefill if p.colocate == decode.name), None)

    @property
    def instances(self) -> list[InstanceConfig]:
        return [*self.prefill, *self.decode]

    @property
    def single_host(self) -> bool:
        hosts = {self.router.host, *(n.host for i in self.instances for n in i.node_list)}
        return all(is_local_host(h) for h in hosts) or len(hosts) == 1

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
                row = {k: v for k, v in dataclasses.asdict(inst).items() if k not in ("engine", "role", "namespace")}
                if inst.colocate is None:
                    del row["colocate"], row["colocate_sms"]
                if not inst.nodes:
                    del row["nodes"], row["dist_init_addr"]
                else:  # each node lists its GPUs
                    del row["devices"]
                row.update(dataclasses.asdict(inst.engine))
                rows.append(row)
            out[role] = rows
        return out

