"""`glm53-serve`: start a PD-disaggregated deployment from a YAML cluster config.

    glm53-serve up --config FILE        every process the YAML places on this host; one ready line
    glm53-serve router --config FILE    the HTTP router only
    glm53-serve prefill --config FILE --instance NAME     one prefill instance
    glm53-serve decode --config FILE --instance NAME      one decode instance
    glm53-serve generate --model DIR --input-ids 1,2,3 --max-new-tokens N   offline greedy
    glm53-serve config --config FILE    validate and print the resolved config (what `up` runs)
    glm53-serve up --config FILE --node-rank K   node K's part of instances that span nodes (cli_nodes.py)
    glm53-serve plan --model DIR --tp 8 [--config FILE]   whether the model fits its GPUs (no weights read)

Flags override the YAML and follow SGLang's names, with the usual vLLM aliases. Under `up` and
`router`, --host/--port are the router's; under `prefill`/`decode`, the instance's. --model
applies to every process. Overrides are applied first; `up` and `config` then validate the same
resolved config, and errors name the user's file and key.

Ports: `up` binds the HTTP port itself (a port in use is refused in one line, before anything
starts) and hands the listening socket to the router it starts, so its "ready" line is about its
own processes; every other endpoint is pinned in the YAML or an ipc name each process binds
itself (config.server_namespace).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

import yaml
import zmq

from glm53.server.cli_nodes import add_instance_flags, add_up_flags, check_instance_flags, instance_overrides
from glm53.server.config import ClusterConfig, ConfigError
from glm53.server.config_parse import load_config, parse_config
from glm53.server.model_fit import check_model_fit
from glm53.server.cli_up import StartupRefused, check_devices, cmd_up

log = logging.getLogger("glm53.serve")

# Test hook: a Python file (or module) whose main(cfg, instance_index) replaces the prefill and
# decode entry points, so the router and `up` can be exercised against test doubles.
INSTANCE_IMPL_ENV = "GLM53_INSTANCE_IMPL"


# --------------------------------------------------------------------------------------------
# Argument parsing
# --------------------------------------------------------------------------------------------


def _add_common(p: argparse.ArgumentParser, engine: bool = True) -> None:
    p.add_argument("--config", "-c", help="YAML cluster config")
    # `up` runs its processes on a resolved copy of the user's file; errors name the user's file.
    p.add_argument("--config-source", dest="config_source", help=argparse.SUPPRESS)
    p.add_argument("--model", "--model-path", dest="model", help="model directory (every process)")
    p.add_argument("--served-model-name", nargs="+", help="names clients may use for the model")
    p.add_argument("--context-length", "--max-model-len", dest="context_length", type=int)
    p.add_argument("--chat-template", help="a .jinja chat template overriding the model's")
    p.add_argument("--skip-tokenizer-init", dest="skip_tokenizer_init", action="store_true", default=None,
                   help="serve token ids only, without a tokenizer (model.skip_tokenizer_init)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    t = p.add_argument_group("transfer")
    t.add_argument("--disaggregation-transfer-backend", "--transfer-backend", dest="transfer_backend")
    t.add_argument("--bootstrap-timeout", dest="bootstrap_timeout_s", type=float)
    t.add_argument("--transfer-timeout", dest="transfer_timeout_s", type=float)
    t.add_argument("--disaggregation-draft-kv-transfer", dest="draft_kv_transfer", choices=["on", "off"],
                   help="prefill sends the DFlash draft's context KV with the target KV (default on)")
    sp = p.add_argument_group("speculative decoding")
    sp.add_argument("--speculative-algorithm", dest="speculative_algorithm", type=str.upper,
                    choices=["NONE", "DFLASH", "DSPARK", "NEXTN", "EAGLE"],
                    help="NEXTN (alias EAGLE): the model's own MTP layer drafts (no draft model)")
    sp.add_argument("--speculative-draft-model-path", dest="speculative_draft_model_path")
    sp.add_argument("--speculative-num-draft-tokens", dest="speculative_num_draft_tokens", type=int)
    sp.add_argument("--speculative-num-steps", dest="speculative_num_steps", type=int,
                    help="NEXTN: proposals the MTP layer chains per verify (default 3)")
    sp.add_argument("--speculative-eagle-topk", dest="speculative_eagle_topk", type=int,
                    help="NEXTN: candidates per step (only 1)")
    sp.add_argument("--speculative-dspark-block-size", dest="speculative_dspark_block_size", type=int,
                    help="DSPARK: tokens a verify checks, the bonus slot included (default the draft's block)")
    sp.add_argument("--speculative-dspark-confidence-threshold", dest="speculative_dspark_confidence_threshold",
                    type=float, help="DSPARK: cut a block before the first position the confidence head rates "
                    "below this (default 0: never)")
    sp.add_argument("--speculative-disable-by-batch-size", dest="speculative_disable_by_batch_size", type=int,
                    help="DFLASH/DSPARK: decode steps of more requests than this verify one token each, "
                    "without drafting (default: never)")
    if not engine:  # the router starts no instance: engine flags would do nothing there
        return
    g = p.add_argument_group("engine (applies to every instance this command starts)")
    g.add_argument("--tp-size", "--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int)
    g.add_argument("--pp-size", "--pp", "-pp", "--pipeline-parallel-size", dest="pp", type=int)
    g.add_argument("--ep-size", "--ep", "-ep", "--expert-parallel-size", dest="ep", type=int,
                   help="expert-parallel groups inside each stage's tp ranks (must divide tp; default 1)")
    g.add_argument("--page-size", type=int)
    g.add_argument("--max-running-requests", "--max-num-seqs", dest="max_running_requests", type=int)
    g.add_argument("--chunked-prefill-size", "--max-num-batched-tokens", dest="chunked_prefill_size", type=int)
    g.add_argument("--num-pages", type=int)
    g.add_argument("--max-total-tokens", type=int)
    g.add_argument("--cuda-graph-max-bs", dest="cuda_graph_max_bs", type=int,
                   help="largest decode batch captured in a CUDA graph (default 64)")
    g.add_argument("--disable-radix-cache", "--no-enable-prefix-caching", dest="disable_radix_cache",
                   action="store_true", default=None, help="prefill: no prefix cache")
    g.add_argument("--disable-cuda-graph", dest="disable_cuda_graph", action="store_true", default=None,
                   help="run every decode step eagerly")
    g.add_argument("--disable-overlap-schedule", dest="disable_overlap_schedule", action="store_true", default=None,
                   help="read every decode step's tokens back before launching the next")
    g.add_argument("--mem-fraction-static", "--gpu-memory-utilization", dest="mem_fraction_static", type=float)
    g.add_argument("--device", choices=["cpu", "cuda"])
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "float32", "fp8_e4m3"])


def _add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="router bind address")
    p.add_argument("--port", type=int, help="router HTTP port (default 30000)")
    p.add_argument("--policy", "--pd-policy", dest="policy", choices=["round_robin", "least_loaded", "random", "cache_aware"])
    p.add_argument("--reasoning-parser", help="split <think> text into reasoning_content (glm45)")
    p.add_argument("--tool-call-parser", help="parse <tool_call> markup into OpenAI tool_calls (glm47)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glm53-serve", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True, metavar="{up,router,prefill,decode,generate,config,plan}")
    up = sub.add_parser("up", help="start every process the config places on this host")
    _add_common(up)
    _add_router_flags(up)
    up.add_argument("--startup-timeout", dest="startup_timeout_s", type=float,
                    help="seconds to wait for readiness (default router.startup_timeout_s)")
    add_up_flags(up)
    r = sub.add_parser("router", help="start the HTTP router")
    _add_common(r, engine=False)
    _add_router_flags(r)
    # `up` binds the HTTP port and hands the listening socket over (kept across router restarts).
    r.add_argument("--listen-fd", dest="listen_fd", type=int, help=argparse.SUPPRESS)
    for role in ("prefill", "decode"):
        s = sub.add_parser(role, help=f"start one {role} instance")
        _add_common(s)
        s.add_argument("--instance", help=f"the {role} instance's name or index in the config (default 0)")
        s.add_argument("--host", help="the instance's bind address")
        s.add_argument("--port", type=int, help="the instance's ZMQ request port")
        s.add_argument("--disaggregation-bootstrap-port", "--bootstrap-port", dest="bootstrap_port", type=int)
        add_instance_flags(s)
    sub.add_parser("generate", help="offline greedy generation with the model core (see generate --help)",
                   add_help=False)
    c = sub.add_parser("config", help="validate a config and print it resolved")
    _add_common(c)
    _add_router_flags(c)
    pl = sub.add_parser("plan", help="whether the model fits each GPU of a layout (reads config.json only)")
    _add_common(pl)
    pl.add_argument("--gpu-memory-gb", dest="gpu_memory_gb", type=float,
                    help="memory of one GPU in GB (1e9 bytes); default this host's GPU 0, else an H200's")
    return ap


_ENGINE_FLAGS = ("tp", "pp", "ep", "page_size", "max_running_requests", "chunked_prefill_size", "num_pages",
                 "max_total_tokens", "mem_fraction_static", "device", "dtype", "kv_cache_dtype", "cuda_graph_max_bs",
                 "disable_cuda_graph", "disable_overlap_schedule", "disable_radix_cache")


def overrides_from_args(args: argparse.Namespace, role: str | None = None, index: int | None = None) -> dict[str, Any]:
    """Command-line flags as `apply_overrides` keys (config.py)."""
    o: dict[str, Any] = {}
    get = lambda k: getattr(args, k, None)  # noqa: E731
    if get("model"):
        o["model.path"] = str(Path(args.model).expanduser().resolve()) if not args.model.startswith("embedded:") \
            else args.model
    o["model.served_model_name"] = get("served_model_name")
    o["model.context_length"] = get("context_length")
    o["model.chat_template"] = get("chat_template")
    o["model.skip_tokenizer_init"] = get("skip_tokenizer_init")
    for k in _ENGINE_FLAGS:
        o[f"engine.{k}"] = get(k)
    o["transfer.backend"] = get("transfer_backend")
    o["transfer.bootstrap_timeout_s"] = get("bootstrap_timeout_s")
    o["transfer.transfer_timeout_s"] = get("transfer_timeout_s")
    algo = get("speculative_algorithm")
    o["speculative.algorithm"] = {"NONE": "none"}.get(algo, algo)
    path = get("speculative_draft_model_path")
    o["speculative.draft_model_path"] = (path if not path or path.startswith("embedded:")
                                         else str(Path(path).expanduser().resolve()))
    o["speculative.num_draft_tokens"] = get("speculative_num_draft_tokens")
    o["speculative.dspark_block_size"] = get("speculative_dspark_block_size")
    o["speculative.num_steps"] = get("speculative_num_steps")
    o["speculative.eagle_topk"] = get("speculative_eagle_topk")
    o["speculative.dspark_confidence_threshold"] = get("speculative_dspark_confidence_threshold")
    o["speculative.disable_by_batch_size"] = get("speculative_disable_by_batch_size")
    kv = get("draft_kv_transfer")
    o["speculative.draft_kv_transfer"] = None if kv is None else kv == "on"
    o["router.log_level"] = get("log_level")
    o["router.policy"] = get("policy")
    o["router.startup_timeout_s"] = get("startup_timeout_s")
    o["router.reasoning_parser"] = get("reasoning_parser")
    o["router.tool_call_parser"] = get("tool_call_parser")
    if role is None:
        o["router.host"] = get("host")
        o["router.port"] = get("port")
    else:
        o.update(instance_overrides(args, role, index))  # --host, --nnodes, --node-rank, --dist-init-addr
        o[f"instance.{role}.{index}.port"] = get("port")
        o[f"instance.{role}.{index}.bootstrap_port"] = get("bootstrap_port")
    return {k: v for k, v in o.items() if v is not None}


def _instance_index(config_path: str, role: str, instance: str | None) -> int:
    """The position of --instance (a name or an index) in the YAML's `role` pool."""
    if instance is None:
        return 0
    try:
        raw = yaml.safe_load(Path(config_path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return 0  # load_config reports the problem with the file and key
    entries = raw.get(role) if isinstance(raw, dict) else None
    entries = entries if isinstance(entries, list) else []
    for i, e in enumerate(entries):
        if isinstance(e, dict) and e.get("name", f"{role[0]}{i}") == instance:
            return i
    if instance.isdigit() and int(instance) < len(entries):
        return int(instance)
    names = [e.get("name", f"{role[0]}{i}") for i, e in enumerate(entries) if isinstance(e, dict)]
    raise ConfigError(config_path, role, f"no {role} instance named {instance!r} (have: {', '.join(names) or 'none'})")


def _load(args: argparse.Namespace, role: str | None = None) -> tuple[ClusterConfig, int]:
    if not args.config:
        raise ConfigError("<command line>", "--config", "a YAML cluster config is required (e.g. configs/local.yaml)")
    index = _instance_index(args.config, role, getattr(args, "instance", None)) if role else 0
    return load_config(args.config, overrides_from_args(args, role, index), getattr(args, "config_source", None)), index


@dataclasses.dataclass
class Resolved:
    cfg: ClusterConfig  # validated as a whole (model fit included); errors name the user's file
    model_dir: Path
    raw: dict[str, Any]  # its YAML form: what `up` hands its processes and `config` prints


def resolve(args: argparse.Namespace, check_fit: bool = True, check_tokenizer: bool = True) -> Resolved:
    """The config `up` runs and `config` prints: the user's file with the command line's
    overrides applied, then validated; the model's (and, with speculation on, the draft's) name
    made a directory, and that resolved form validated again with the model's and the draft's
    config.json — exactly what each process `up` starts loads and checks again; then (unless
    `check_fit` is False) every GPU instance's memory plan (server/plan.py). With speculation off
    the draft is neither checked nor installed. `check_tokenizer`: the router's tokenizer exists
    (or the config serves token ids only)."""
    from glm53.server import embedded_model

    cfg, _ = _load(args)
    model_dir, cfg = embedded_model.resolve_paths(cfg)
    raw = cfg.to_dict()
    raw["model"]["path"] = str(model_dir)
    cfg = parse_config(raw, source=cfg.source)
    check_model_fit(cfg, model_dir)
    if check_fit:
        # imported here: the plan builds models on the meta device (torch), and the router
        # process starts through this module too; it needs no torch (~240 MB of RSS)
        from glm53.server.plan import check_cluster_fits

        check_cluster_fits(cfg, model_dir)
    if check_tokenizer:  # last: a layout or model error is the one to fix first
        embedded_model.check_tokenizer(cfg, model_dir)
    return Resolved(cfg, model_dir, raw)


# --------------------------------------------------------------------------------------------
# Subcommands
# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "generate":
        return _generate(argv[1:])
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", None) or "info"
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        if args.command == "up":
            return cmd_up(args, resolve)
        if args.command == "config":
            print(yaml.safe_dump(resolve(args).raw, sort_keys=False), end="")
            return 0
        if args.command == "plan":
            from glm53.server.cli_plan import cmd_plan

            return cmd_plan(args, resolve)
        if args.command == "router":
            cfg, _ = _load(args)
            from glm53.server.router.app import main as router_main

            return router_main(cfg, listen_fd=args.listen_fd)
        if args.command in ("prefill", "decode"):
            cfg, index = _load(args, args.command)
            if 0 <= index < len(cfg.pool(args.command)):
                inst = cfg.pool(args.command)[index]
                node = check_instance_flags(cfg, inst, args)
                check_devices(cfg, [inst], node=node)
                if node > 0:  # this node's ranks of an instance whose scheduler runs on node 0
                    from glm53.server.engine.node_ranks import run_node

                    return run_node(cfg, inst, node, Path(args.ready_file) if args.ready_file else None)
            return _instance_entry(args.command)(cfg, index) or 0
    except ConfigError as e:
        print(f"glm53-serve: config error: {e}", file=sys.stderr)
        return 2
    except StartupRefused as e:
        print(f"glm53-serve: cannot start: {e}", file=sys.stderr)
        return 1
    except zmq.ZMQError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        # A pinned port (or this server's ipc name) that another process holds: one line, and
        # under `up` an exit it reports rather than a traceback per restart.
        print(f"glm53-serve {args.command}: cannot bind: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


def _generate(argv: list[str]) -> int:
    try:
        offline = importlib.import_module("glm53.server.offline")
    except ModuleNotFoundError as e:
        if e.name != "glm53.server.offline":
            raise
        print("glm53-serve generate: offline generation (glm53.server.offline) is not available yet",
              file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="glm53-serve generate", description="offline greedy generation")
    offline.add_generate_args(p)
    return int(offline.run_generate(p.parse_args(argv)) or 0)


def _instance_entry(role: str) -> Callable[[ClusterConfig, int], int | None]:
    impl = os.environ.get(INSTANCE_IMPL_ENV)
    if impl:
        if impl.endswith(".py"):
            spec = importlib.util.spec_from_file_location("glm53_instance_impl", impl)
            assert spec and spec.loader
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # dataclasses look their module up there
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(impl)
        return mod.main
    return _run_decode if role == "decode" else _engine_main(role)


def _engine_main(role: str) -> Callable[[ClusterConfig, int], int | None]:
    name = f"glm53.server.engine.{role}"
    try:
        return importlib.import_module(name).main
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
        raise SystemExit(f"glm53-serve {role}: the {role} instance ({name}) is not available yet")


def _run_decode(cluster: ClusterConfig, index: int) -> int | None:
    """`glm53-serve decode`: a decode instance that a prefill instance colocates with runs together
    with it, one process on one GPU (engine/colocate.py); any other runs alone (engine/decode.py).
    The choice is made here, above both: colocate.py builds a `DecodeScheduler`."""
    dec = cluster.decode[index] if 0 <= index < len(cluster.decode) else None  # else decode.main says so
    partner = cluster.colocated_prefill(dec) if dec is not None else None
    if partner is None:
        return _engine_main("decode")(cluster, index)
    from glm53.server.engine.colocate import run_colocated

    return run_colocated(cluster, dec, partner)


if __name__ == "__main__":
    sys.exit(main())
