"""`glm53-serve up` as a supervisor, with real processes (router + test-double instances): a crashed
instance or router is restarted with backoff and re-admitted, a clean stop is not restarted, a
crash loop is given up on (and `up` stops when no instance of a role is left), and `up`'s
temporary directory goes away on exit and is swept up after an `up` that was killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx

from .conftest import start_cluster


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def healthy(c) -> bool:
    try:
        return httpx.get(c.url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie has exited; its parent (`up`) reaps it on its next look.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] == "Z"


def router_pid(c) -> int:
    out = subprocess.run(["pgrep", "-P", str(c.proc.pid), "-f", "glm53.server.cli router"],
                         capture_output=True, text=True).stdout.split()
    assert out, "no router process"
    return int(out[0])


def test_crashes_are_restarted_clean_stops_are_not(tmp_path, model_dir, glm53_cache):
    c = start_cluster(tmp_path, model_dir, glm53_cache, n_prefill=1, n_decode=2,
                      router={"restart_backoff_s": 0.2, "max_restarts": 2},
                      env={"FAKE_TOKEN_DELAY": "0.02", "FAKE_CRASH_ON_RESTART": "d1"})
    try:
        # kill -9 of the decode instance serving a stream: the client gets an error event and
        # [DONE], `up` starts d0 again and the router re-admits it.
        old = c.pid("d0")
        with httpx.stream("POST", c.url + "/v1/completions", timeout=30, json={
                "prompt": [400], "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            next(lines)
            victim = next(i["name"] for i in c.server_info()["decode"] if i["in_flight"] == 1)
            os.kill(c.pid(victim), signal.SIGKILL)
            rest = [x for x in lines if x]
        assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2][6:])
        if victim == "d1":  # d1 crash-loops below; this test wants d0 dead once first
            os.kill(old, signal.SIGKILL)
        wait_for(lambda: c.pid("d0") != old and healthy(c), 30, "d0 restarted and healthy")
        wait_for(lambda: all(i["healthy"] for i in c.server_info()["decode"] if i["name"] == "d0"), 15,
                 "d0 re-admitted")
        for _ in range(3):
            r = httpx.post(c.url + "/v1/completions", json={"prompt": [400], "max_tokens": 3}, timeout=30)
            assert r.status_code == 200, r.text

        # d1 exits with code 3 at every restart: a crash loop, given up after 2 restarts; `up`
        # keeps serving with d0.
        if victim != "d1":
            os.kill(c.pid("d1"), signal.SIGKILL)
        wait_for(lambda: "d1 exited (code 3) after 2 restarts" in c.log_path.read_text(), 30, "give-up on d1")
        assert c.proc.poll() is None and healthy(c)

        # The router crashes: restarted, the instances' pings reach the new one.
        rpid = router_pid(c)
        os.kill(rpid, signal.SIGKILL)
        wait_for(lambda: healthy(c), 60, "router back")
        assert router_pid(c) != rpid
        r = httpx.post(c.url + "/v1/completions", json={"prompt": [400], "max_tokens": 3}, timeout=30)
        assert r.status_code == 200, r.text

        # A clean stop (SIGTERM to p0, which exits 0) is left alone.
        p0 = c.pid("p0")
        os.kill(p0, signal.SIGTERM)
        wait_for(lambda: "p0 stopped cleanly (code 0); not restarting it" in c.log_path.read_text(), 15,
                 "clean stop logged")
        time.sleep(1.0)
        assert gone(p0) and c.pid("p0") == p0 and c.proc.poll() is None
    finally:
        assert c.stop() == 0
    log = c.log_path.read_text()
    assert "d0 exited (killed by SIGKILL); restarting it in 0.2 s" in log
    assert "crash loop; giving up on it" in log and "d1 stays down" in log
    assert "router exited (killed by SIGKILL); restarting it" in log


def test_crash_loop_of_the_last_instance_stops_up_and_temp_dirs_are_cleaned(tmp_path, model_dir, glm53_cache):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # What an `up` killed with SIGKILL leaves behind: its directory, naming a pid now dead.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp / "glm53-up-killed"
    stale.mkdir()
    (stale / "up.pid").write_text(str(dead.pid))
    (stale / "cluster.yaml").write_text("{}")
    live = tmp / "glm53-up-running"  # another `up`, still running: left alone
    live.mkdir()
    (live / "up.pid").write_text(str(os.getpid()))

    c = start_cluster(tmp_path / "c", model_dir, glm53_cache,
                      router={"restart_backoff_s": 0.2, "max_restarts": 1},
                      env={"TMPDIR": str(tmp), "FAKE_CRASH_ON_RESTART": "d0"})
    try:
        assert not stale.exists() and live.exists()
        ours = [d for d in tmp.glob("glm53-up-*") if d != live]
        assert len(ours) == 1 and (ours[0] / "cluster.yaml").exists()
        os.kill(c.pid("d0"), signal.SIGKILL)
        assert c.proc.wait(30) == 1
    finally:
        c.stop()
    log = c.log_path.read_text()
    assert "d0 exited (code 3) after 1 restarts" in log and "no decode instance is left" in log
    assert not ours[0].exists()  # removed on the way out
    assert gone(c.pid("p0"))
