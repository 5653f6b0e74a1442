"""A test double for prefill/decode instances that speaks server/protocol.py exactly.

Loaded by `glm53-serve prefill|decode` when GLM53_INSTANCE_IMPL points at this file. No model:
decode "generates" deterministic tokens from the prompt (so greedy requests are reproducible),
one token per active room per tick, like a continuous batch, and decides each finish as the real
decode does (stop token, eos, stop string through engine/stops.py, length). Behaviour knobs (environment):

    FAKE_TOKEN_DELAY   seconds per decode step (default 0.002)
    FAKE_FIRST_TOKEN_DELAY  seconds decode waits before a room's first token (the "transfer")
    FAKE_EOS_AT        emit the first eos id as output token N (0-based) unless ignore_eos
    FAKE_PID_DIR       write <name>.pid there (tests kill instances by pid)
    FAKE_PREFILL_FAIL  prefill fails every room with this error message
    FAKE_PREFILL_FAIL_ONLY  comma-separated instance names FAKE_PREFILL_FAIL applies to (default all)
    FAKE_TRANSFER_BYTES  prefill reports a transfer of this many bytes per room
    FAKE_CRASH_ON_RESTART  comma-separated instance names that exit with code 3 at start when
                       they ran before (their pid file exists): a crash loop under `up`
    FAKE_SCRIPTS       a JSON file holding a list of token id lists: a request with
                       seed SCRIPT_SEED + i emits script i, one token a step, then the first eos id
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass

from glm53.server.config import ClusterConfig
from glm53.server.engine.stops import StopStrings, StopText
from glm53.server.protocol import (Abort, GenerateRequest, InstanceChannel, LoadStats, TokenEvent,
                                   TransferStats)

# Plain BPE ids of the embedded tokenizer (below its 4096 merges; no specials).
TOKEN_LO, TOKEN_HI = 300, 3800
SCRIPT_SEED = 7_000_000


def fake_token(input_ids: list[int], step: int, seed: int | None = None) -> int:
    h = (sum((i + 1) * t for i, t in enumerate(input_ids[-16:])) + 7919 * step + (seed or 0)) % (TOKEN_HI - TOKEN_LO)
    return TOKEN_LO + h


@dataclass
class _Room:
    req: GenerateRequest
    start_at: float = 0.0
    step: int = 0
    stops: StopText | None = None


def main(cfg: ClusterConfig, index: int) -> int:
    # Exactly one of the two pools is ours: GLM53 passes the role through argv.
    role = "decode" if "decode" in sys.argv[1:2] else "prefill"
    inst = cfg.pool(role)[index]
    delay = float(os.environ.get("FAKE_TOKEN_DELAY", "0.002"))
    first_delay = float(os.environ.get("FAKE_FIRST_TOKEN_DELAY", "0"))
    eos_at = int(os.environ["FAKE_EOS_AT"]) if os.environ.get("FAKE_EOS_AT") else None
    prefill_fail = os.environ.get("FAKE_PREFILL_FAIL")
    only = [n for n in os.environ.get("FAKE_PREFILL_FAIL_ONLY", "").split(",") if n]
    if only and inst.name not in only:
        prefill_fail = None
    transfer_bytes = int(os.environ.get("FAKE_TRANSFER_BYTES", "0"))
    scripts = []
    if os.environ.get("FAKE_SCRIPTS"):
        with open(os.environ["FAKE_SCRIPTS"]) as f:
            scripts = json.load(f)
    if os.environ.get("FAKE_PID_DIR"):
        pid_file = os.path.join(os.environ["FAKE_PID_DIR"], f"{inst.name}.pid")
        if inst.name in os.environ.get("FAKE_CRASH_ON_RESTART", "").split(",") and os.path.exists(pid_file):
            return 3
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))

    rooms: dict[int, _Room] = {}
    stop_strings = StopStrings(cfg)
    load = {"v": LoadStats(page_size=inst.engine.page_size, kv_pages_total=inst.engine.num_pages or 1024)}
    ch = InstanceChannel(inst.address, inst.name, role, load_fn=lambda: load["v"])
    stopping = {"v": False}
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__("v", True))
    ch.ready = True
    try:
        while not stopping["v"]:
            msgs = ch.drain() if rooms else [m for m in [ch.get(timeout=0.05)] if m is not None] + ch.drain()
            for m in msgs:
                if isinstance(m, GenerateRequest):
                    if role == "prefill":
                        if prefill_fail:
                            ch.send(m.reply_to, TokenEvent(room=m.room, generation=m.generation, instance=inst.name,
                                                           finish_reason="error", error=prefill_fail,
                                                           error_code="transfer_failed"))
                        elif transfer_bytes:
                            ch.send(m.reply_to, TokenEvent(room=m.room, generation=m.generation, instance=inst.name,
                                                           transfer=TransferStats(0.001, transfer_bytes, 0.0005)))
                    else:
                        rooms[m.room] = _Room(m, start_at=time.monotonic() + first_delay,
                                              stops=stop_strings.new(m.spec.params))
                elif isinstance(m, Abort):
                    rooms.pop(m.room, None)
            if role == "decode" and rooms:
                time.sleep(delay)
                with ch.batched():  # one frame per step, as the real engine sends
                    step_rooms(ch, rooms, scripts, eos_at, inst.name)
            load["v"] = LoadStats(num_running=len(rooms), page_size=inst.engine.page_size,
                                  kv_pages_used=len(rooms), kv_pages_total=inst.engine.num_pages or 1024)
    finally:
        ch.close()
    return 0


def step_rooms(ch: InstanceChannel, rooms: dict[int, _Room], scripts: list, eos_at: int | None, name: str) -> None:
    """One decode "step": a token for every room past its first-token delay."""
    for rid, r in list(rooms.items()):
        q, spec = r.req, r.req.spec
        if time.monotonic() < r.start_at:
            continue
        if spec.params.max_new_tokens == 0:  # nothing to generate: the room ends at once
            ch.send(q.reply_to, TokenEvent(room=q.room, generation=q.generation, instance=name, finish_reason="length",
                                           prompt_tokens=len(spec.input_ids)))
            del rooms[rid]
            continue
        script = (spec.params.seed or 0) - SCRIPT_SEED
        if 0 <= script < len(scripts):
            tok = scripts[script][r.step] if r.step < len(scripts[script]) else spec.eos_token_ids[0]
        elif eos_at is not None and r.step == eos_at and not spec.params.ignore_eos:
            tok = spec.eos_token_ids[0]
        else:
            tok = fake_token(spec.input_ids, r.step, spec.params.seed)
        r.step += 1
        finish, matched = None, None
        if tok in spec.stop_ids:
            finish, matched = "stop", tok
        elif r.stops is not None and (s := r.stops.add(tok)) is not None:
            finish, matched = "stop", s
        elif r.step >= spec.params.max_new_tokens:
            finish = "length"
        ch.send(q.reply_to, TokenEvent(room=q.room, generation=q.generation, instance=name,
                                       token_ids=[tok], finish_reason=finish, matched_stop=matched,
                                       prompt_tokens=len(spec.input_ids), completion_tokens=r.step))
        if finish:
            del rooms[rid]
