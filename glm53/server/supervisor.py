"""What `glm53-serve up` uses to keep its processes running: `Supervisor` (children in their own
process groups, restarted after a crash) and `RunDir` (its temporary directory, removed on every
exit it can see, and swept up after an `up` that was killed).

Restart policy: a child that exits with code 0 stopped cleanly (SIGTERM to it, or its own choice)
and stays stopped. Any other exit — a signal such as SIGKILL, or an error code — is a crash: the
child is started again after `backoff_s`, doubled for every earlier restart still inside
`window_s` (at most 60 s). One restart more than `max_restarts` within the window is a crash
loop: the supervisor gives up on that child and says so. Nothing it spawns outlives it: children
get SIGTERM if `up` dies (PR_SET_PDEATHSIG), and when a child exits its whole process group is
killed at once (while the group id cannot yet belong to anyone else), so no orphaned rank
process holds its ports or GPUs into the restart.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("glm53.serve")

MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen
    pass_fds: tuple[int, ...] = ()  # inherited by every start (the router's HTTP socket)
    restarts: deque = field(default_factory=deque)  # monotonic times of restarts in the window
    restart_at: float | None = None  # a crash was seen; start it again then
    state: str = "running"  # running | restarting | stopped (clean exit) | given_up
    last_code: int | None = None


@dataclass(frozen=True)
class Event:
    """What `Supervisor.poll` saw: kind is crashed | restarted | stopped | given_up."""

    name: str
    kind: str
    code: int | None = None


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


def _set_pdeathsig() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGTERM to the child if `up`
    # dies without cleaning up (e.g. SIGKILL), so no instance outlives its supervisor.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Supervisor:
    """Child processes, each in its own process group (so Ctrl-C reaches only `up`, and stopping
    a child also stops anything it spawned)."""

    def __init__(self, policy: RestartPolicy = RestartPolicy()) -> None:
        self.policy = policy
        self.children: dict[str, Child] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> None:
        """Start a child; `pass_fds` stay open in it, and in every restart of it."""
        self.children[name] = Child(name, argv, env, self._start(argv, env, pass_fds), pass_fds)

    @staticmethod
    def _start(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        return subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_set_pdeathsig, pass_fds=pass_fds)

    def exited(self) -> list[tuple[str, int]]:
        """Children that have exited (startup uses this: any exit there is fatal)."""
        return [(c.name, c.proc.returncode) for c in self.children.values() if c.proc.poll() is not None]

    def alive(self, name: str) -> bool:
        return self.children[name].state in ("running", "restarting")

    def poll(self, now: float | None = None) -> list[Event]:
        """Notice exits, schedule restarts, perform the ones that are due."""
        now = time.monotonic() if now is None else now
        events: list[Event] = []
        for c in self.children.values():
            if c.state == "running" and c.proc.poll() is not None:
                events.append(self._on_exit(c, now))
            elif c.state == "restarting" and c.restart_at is not None and now >= c.restart_at:
                c.proc = self._start(c.argv, c.env, c.pass_fds)
                c.state, c.restart_at = "running", None
                log.warning("%s restarted (pid %d)", c.name, c.proc.pid)
                events.append(Event(c.name, "restarted"))
        return events

    def _on_exit(self, c: Child, now: float) -> Event:
        code = c.last_code = c.proc.returncode
        # Its rank processes, if any. The group id stays reserved while a member lives, so this
        # cannot reach an unrelated group; later (after they are gone) it could.
        _killpg(c.proc.pid, signal.SIGKILL)
        if code == 0:
            c.state = "stopped"
            log.warning("%s stopped cleanly (code 0); not restarting it", c.name)
            return Event(c.name, "stopped", code)
        p = self.policy
        while c.restarts and now - c.restarts[0] > p.window_s:
            c.restarts.popleft()
        if len(c.restarts) >= p.max_restarts:
            c.state = "given_up"
            log.error("%s exited (%s) after %d restarts within %g s: a crash loop; giving up on it",
                      c.name, describe_exit(code), len(c.restarts), p.window_s)
            return Event(c.name, "given_up", code)
        delay = min(p.backoff_s * 2 ** len(c.restarts), MAX_BACKOFF_S)
        c.restarts.append(now)
        c.state, c.restart_at = "restarting", now + delay
        log.error("%s exited (%s); restarting it in %g s (restart %d of at most %d within %g s)",
                  c.name, describe_exit(code), delay, len(c.restarts), p.max_restarts, p.window_s)
        return Event(c.name, "crashed", code)

    def stop(self, timeout: float = 10.0) -> None:
        # Only children still running: an exited one's group was killed when its exit was seen.
        live = [c for c in self.children.values() if c.state == "running"]
        for c in live:
            if c.proc.poll() is None:
                _killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in live:
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", c.name, timeout)
        for c in live:
            # The group may hold grandchildren even after the leader exited.
            _killpg(c.proc.pid, signal.SIGKILL)
            if c.proc.poll() is None:
                c.proc.wait(5)


class RunDir:
    """`up`'s temporary directory (the resolved config its children read). Removed at exit
    (the caller's `finally`, and atexit as a backstop); an `up` killed with SIGKILL cannot, so
    the next `up` removes directories whose owner is gone (an `up.pid` naming a dead process)."""

    PREFIX = "glm53-up-"
    STALE_WITHOUT_PID_S = 3600.0  # a directory from an older version, or one killed mid-creation

    def __init__(self, parent: str | None = None):
        self.parent = Path(parent or tempfile.gettempdir())
        self.removed = sweep_stale(self.parent, self.PREFIX, self.STALE_WITHOUT_PID_S)
        self.path = Path(tempfile.mkdtemp(prefix=self.PREFIX, dir=self.parent))
        (self.path / "up.pid").write_text(str(os.getpid()))
        atexit.register(self.remove)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def sweep_stale(parent: Path, prefix: str, stale_without_pid_s: float) -> list[Path]:
    """Remove this user's `prefix*` directories whose `up` is no longer running."""
    removed = []
    for d in parent.glob(prefix + "*"):
        try:
            if not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
            pid_file = d / "up.pid"
            if pid_file.exists():
                if _running(int(pid_file.read_text().strip() or 0)):
                    continue
            elif time.time() - d.stat().st_mtime < stale_without_pid_s:
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
