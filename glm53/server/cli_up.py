"""`glm53-serve up`: every process the YAML places on this host under one supervisor, with one
ready line (cli.py parses the command line and hands `cmd_up` its `resolve`). Before anything
starts: the HTTP port bound here (a taken port refused in one line), pinned ports and GPUs
checked; then the router, prefill and decode processes started, watched and restarted by
`Supervisor`, and stopped together."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import yaml

from glm53.server.cli_nodes import NodePart, node_role
from glm53.server.config import ClusterConfig, ConfigError, InstanceConfig
from glm53.server.config_parse import parse_config
from glm53.server.supervisor import Event, RestartPolicy, RunDir, Supervisor

log = logging.getLogger("glm53.serve")


class StartupRefused(Exception):
    """`up` cannot start here (a port it must bind is taken); one line, nothing started."""




def local_addresses() -> set[str]:
    names = {"127.0.0.1", "localhost", "0.0.0.0", "::1", "::", "", socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None):
            names.add(str(info[4][0]))
    except OSError:
        pass
    return names


def cmd_up(args: argparse.Namespace, resolve: Callable[..., Any]) -> int:
    res = resolve(args)
    cfg, model_dir = res.cfg, res.model_dir
    here = local_addresses()
    node = getattr(args, "node_rank", None)
    r = cfg.router
    parts: list[NodePart] = []
    if node is None:
        local = [i for i in cfg.instances if i.host in here]
        # A wildcard router host says nothing about which machine runs it; advertise_host does.
        run_router = (r.advertise_host in here) if r.advertise_host else (r.host in here)
    else:  # the operator names the node (cli_nodes.py); hosts are not matched
        role = node_role(cfg, node)
        local, parts, run_router = role.local, role.parts, role.run_router
    if not local and not run_router and not parts:
        raise ConfigError(cfg.source, "", f"no process of this config runs on this host ({socket.gethostname()})")
    check_devices(cfg, local, getattr(args, "device", None))
    for part in parts:
        check_devices(cfg, [part.inst], getattr(args, "device", None), node=part.node)

    # The ports this `up` must bind, before anything starts: the HTTP port it binds itself and
    # keeps (the router it starts serves on that socket, so the readiness check can only reach
    # its own router), then the pinned ones its processes will bind.
    listener = listen_http(cfg) if run_router else None
    try:
        if listener is not None and r.port == 0:  # `--port 0`: the processes get the bound port
            res.raw["router"]["port"] = listener.getsockname()[1]
            cfg = parse_config(res.raw, source=cfg.source)
            local = [i for i in cfg.instances if any(i.name == j.name for j in local)]
        check_pinned_ports(cfg, local, run_router)
        return _run(cfg, res.raw, model_dir, local, run_router, listener, parts)
    finally:
        if listener is not None:
            listener.close()


def _run(cfg: ClusterConfig, resolved: dict[str, Any], model_dir: Path, local: list[InstanceConfig],
         run_router: bool, listener: socket.socket | None, parts: list[NodePart] = ()) -> int:
    r = cfg.router
    env = dict(os.environ)
    if cfg.single_host and "UCX_NET_DEVICES" not in env:
        env["UCX_NET_DEVICES"] = "lo"  # one host: keep UCX on loopback, away from absent NICs

    sup = Supervisor(RestartPolicy(r.max_restarts, r.restart_window_s, r.restart_backoff_s))
    stop = {"sig": None}

    def on_signal(sig, _frame):
        stop["sig"] = sig

    # SIGHUP too (the terminal went away): every exit `up` can see removes its directory.
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    run_dir = RunDir()
    for d in run_dir.removed:
        log.info("removed %s, left behind by an `up` that is no longer running", d)
    try:
        cfg_file = run_dir.path / "cluster.yaml"
        cfg_file.write_text(f"# resolved from {cfg.source} by glm53-serve up\n"
                            + yaml.safe_dump(resolved, sort_keys=False))
        exe = [sys.executable, "-m", "glm53.server.cli"]
        common = ["--config", str(cfg_file), "--config-source", cfg.source]
        for inst in local:
            if inst.colocate is None:  # a colocated prefill runs in its decode instance's process
                sup.spawn(inst.name, [*exe, inst.role, *common, "--instance", inst.name], env)
        if run_router:
            fd = listener.fileno()
            sup.spawn("router", [*exe, "router", *common, "--listen-fd", str(fd)], env, pass_fds=(fd,))
        for part in parts:  # another node's ranks of an instance across nodes (engine/node_ranks.py)
            sup.spawn(part.name, [*exe, part.inst.role, *common, "--instance", part.inst.name, "--node-rank",
                                  str(part.node), "--ready-file", str(part.ready_file(run_dir.path))], env)
        ready_files = {p.name: p.ready_file(run_dir.path) for p in parts}
        ok = _wait_ready(cfg, local, run_router, sup, stop, cfg.router.startup_timeout_s, ready_files)
        if not ok:
            return 130 if stop["sig"] is not None else 1
        pools = "; ".join(f"{r} {', '.join(i.name for i in cfg.pool(r))}" for r in ("prefill", "decode"))
        what = f"{_http_url(cfg)} (model {(cfg.model.served_model_name or [model_dir.name])[0]}; {pools})" \
            if run_router else ", ".join([*(f"instances {i.name}" for i in local),
                                          *(f"node {p.node} of {p.inst.name}" for p in parts)]) \
            + f" (router at {r.host}:{r.port})"
        print(f"glm53-serve ready: {what}", flush=True)
        while stop["sig"] is None:
            rc = _supervise(cfg, local, sup, sup.poll())
            if rc is not None:
                return rc
            time.sleep(0.2)
        log.info("stopping (signal %s)", stop["sig"])
        return 0
    finally:
        sup.stop()
        for s, h in old.items():
            signal.signal(s, h)
        run_dir.remove()


def _http_url(cfg: ClusterConfig) -> str:
    host = cfg.router.result_host if cfg.router.host in ("0.0.0.0", "::", "") else cfg.router.host
    return f"http://{host}:{cfg.router.port}"


def listen_http(cfg: ClusterConfig) -> socket.socket:
    """The router's HTTP socket, bound and listening (inheritable: the router gets it). A port
    in use is refused in one line: another server holds it."""
    host, port = cfg.router.host, cfg.router.port
    try:
        v6 = ":" in host
        # "::" serves IPv4 too, as uvicorn's own bind does (and the readiness probe uses 127.0.0.1).
        sock = socket.create_server((host, port), family=socket.AF_INET6 if v6 else socket.AF_INET, backlog=2048,
                                    dualstack_ipv6=v6 and host == "::" and socket.has_dualstack_ipv6())
    except OSError as e:
        what = "is already in use (another server?)" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise StartupRefused(f"{cfg.source}: router.port: {host}:{port} {what}") from None
    sock.set_inheritable(True)
    return sock


def check_pinned_ports(cfg: ClusterConfig, local: list[InstanceConfig], run_router: bool) -> None:
    """Refuse (one line, before anything starts) a port the YAML pins for a process of this host
    that another process holds. Unpinned endpoints need no check: each process binds its own."""
    pinned = [("router.result_port", cfg.router.host, cfg.router.result_port)] if run_router else []
    for inst in local:
        key = f"{inst.role}[{cfg.pool(inst.role).index(inst)}]"
        pinned += [(f"{key}.port", inst.host, inst.port), (f"{key}.bootstrap_port", inst.host, inst.bootstrap_port),
                   (f"{key}.dist_init_port", inst.host, inst.engine.dist_init_port)]
        if inst.dist_init_addr:  # rank 0's rendezvous store listens there
            pinned.append((f"{key}.dist_init_addr", *inst.rendezvous))
    for key, host, port in pinned:
        if port is not None and _in_use(host, port):
            raise StartupRefused(f"{cfg.source}: {key}: {host}:{port} is already in use (another server?)")


def _in_use(host: str, port: int) -> bool:
    # SO_REUSEADDR as ZMQ and uvicorn bind: a port in TIME_WAIT is free to them.
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def check_devices(cfg: ClusterConfig, insts: list[InstanceConfig], flag: str | None = None, node: int = 0) -> None:
    """Instances of this host on `device: cuda` need CUDA here, and the GPUs they list (`node`:
    which of their nodes this host is): a config error naming the key, not a traceback from deep
    inside torch."""
    cuda = [i for i in insts if i.engine.device == "cuda"]
    if not cuda:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for inst in cuda:
        key = f"{inst.role}[{cfg.pool(inst.role).index(inst)}]"
        if count == 0:
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ConfigError(cfg.source, "--device" if flag else _device_key(cfg, key),
                              f"'cuda', but {why} on this host ({socket.gethostname()}); use device: cpu")
        for d in inst.node_list[node].devices:
            if d >= count:
                where = f"{key}.nodes[{node}].devices" if inst.nodes else f"{key}.devices"
                raise ConfigError(cfg.source, where, f"GPU {d} does not exist on this host "
                                  f"({count} visible: 0..{count - 1})")


def _device_key(cfg: ClusterConfig, key: str) -> str:
    """Where the user's file sets an instance's device: its entry, else `defaults`."""
    try:
        raw = yaml.safe_load(Path(cfg.source).read_text()) or {}
        role, index = key[:-1].split("[")
        if "device" not in raw[role][int(index)] and "device" in (raw.get("defaults") or {}):
            return "defaults.device"
    except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError, ValueError, AttributeError):
        pass
    return f"{key}.device"


def process_name(inst: InstanceConfig) -> str:
    """The supervised process an instance runs in: its own, or its colocated decode instance's."""
    return inst.colocate or inst.name


def _supervise(cfg: ClusterConfig, local, sup: Supervisor, events: list[Event]) -> int | None:
    """React to what the supervisor saw; an exit code when `up` must stop everything. A
    restarted instance needs nothing more: the router's health pings re-admit it once it
    answers ready, as they do for any instance that comes back."""
    for ev in events:
        if ev.name == "router" and ev.kind in ("stopped", "given_up"):
            log.error("the router is gone (%s); stopping everything", ev.kind.replace("_", " "))
            return 0 if ev.kind == "stopped" else 1
        if ev.kind == "given_up":
            # Instances on other hosts may still serve; when none of a role is left, nothing can.
            for role in {i.role for i in local if process_name(i) == ev.name}:
                if all(i in local and not sup.alive(process_name(i)) for i in cfg.pool(role)):
                    log.error("no %s instance is left; stopping everything", role)
                    return 1
            log.error("%s stays down; the router routes around it", ev.name)
    return None


def _wait_ready(cfg: ClusterConfig, local, run_router: bool, sup: Supervisor, stop: dict, timeout: float,
                ready_files: dict[str, Path] | None = None) -> bool:
    """`ready_files`: node parts (name -> the file that exists once their ranks joined the group)."""
    from glm53.server.protocol import probe

    deadline = time.monotonic() + timeout
    ready_files = ready_files or {}
    pending = {i.name for i in local} | set(ready_files)
    router_ok = not run_router
    while time.monotonic() < deadline:
        if stop["sig"] is not None:
            return False
        dead = sup.exited()
        if dead:
            name, rc = dead[0]
            print(f"glm53-serve: {name} exited during startup (code {rc}); stopping", file=sys.stderr)
            return False
        pending -= {name for name, f in ready_files.items() if f.exists()}
        if pending - set(ready_files):
            ready = probe({i.name: i.address for i in local if i.name in pending}, timeout=0.5)
            pending -= ready
        if not pending and not router_ok:
            router_ok = _router_sees_healthy(cfg, {i.name for i in local})
        if not pending and router_ok:
            return True
        time.sleep(0.3)
    waiting = sorted(pending) + ([] if router_ok else ["router"])
    print(f"glm53-serve: not ready after {timeout:g} s (waiting for {', '.join(waiting)}); stopping", file=sys.stderr)
    return False


def _router_sees_healthy(cfg: ClusterConfig, names: set[str]) -> bool:
    """The router answers /health and has marked every instance in `names` healthy. Its /health
    needs only one healthy pair; `up` says ready only once each local instance has ponged ready
    to the router too, so a request sent right after sees the whole deployment."""
    # The HTTP socket is `up`'s own (listen_http): only the router it started answers here.
    try:
        with urllib.request.urlopen(f"{_http_url(cfg)}/health", timeout=2) as r:
            if r.status != 200 or json.loads(r.read()).get("status") != "ok":
                return False
        with urllib.request.urlopen(f"{_http_url(cfg)}/server_info", timeout=2) as r:
            info = json.loads(r.read())
    except (OSError, ValueError):
        return False
    healthy = {i["name"] for role in ("prefill", "decode") for i in info.get(role, []) if i.get("healthy")}
    return names <= healthy

