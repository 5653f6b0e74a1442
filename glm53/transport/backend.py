"""The transfer backend interface and its NIXL (UCX) implementation.

``import_nixl()`` is the one shim through which NIXL is imported: it prefers ``nixl_cu13`` (GPU
hosts whose torch is a CUDA 13 build carry that wheel) and falls back to ``nixl_cu12`` (the
project dependency; runs CPU-only). ``GLM53_NIXL_MODULE`` overrides the choice.

The engine talks only to ``TransferBackend``; NIXL is one implementation of it. Every method
returns promptly (no blocking waits); errors from NIXL (a peer that disconnected, a bad
descriptor) become an ``"ERR"`` transfer state or a ``BackendError``, never a dead thread.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

log = logging.getLogger("glm53.transport")

DONE, PROC, ERR = "DONE", "PROC", "ERR"


class BackendError(RuntimeError):
    pass


@dataclass(frozen=True)
class MemRegion:
    """A registered contiguous region: host (``DRAM``) or CUDA (``VRAM``, ``device`` = GPU id)."""

    addr: int
    nbytes: int
    mem: str = "DRAM"
    device: int = 0

    @staticmethod
    def of(obj: Any) -> "MemRegion":
        """From a contiguous torch tensor, a numpy array, or a MemRegion."""
        if isinstance(obj, MemRegion):
            return obj
        if isinstance(obj, np.ndarray):
            if not obj.flags["C_CONTIGUOUS"]:
                raise ValueError("numpy pool must be C-contiguous")
            return MemRegion(int(obj.ctypes.data), int(obj.nbytes), "DRAM", 0)
        if hasattr(obj, "data_ptr"):  # torch.Tensor
            if not obj.is_contiguous():
                raise ValueError("torch pool must be contiguous")
            dev = obj.get_device() if obj.is_cuda else -1
            return MemRegion(int(obj.data_ptr()), int(obj.numel() * obj.element_size()),
                             "VRAM" if dev >= 0 else "DRAM", max(dev, 0))
        raise TypeError(f"cannot register {type(obj).__name__}")


class Xfer:
    """A posted transfer. ``state`` is PROC until the backend reports DONE or ERR."""

    __slots__ = ("handle", "peer", "state", "error", "nbytes", "ndesc", "tag")

    def __init__(self, handle, peer: str, state: str, error: str = "", nbytes: int = 0,
                 ndesc: int = 0, tag: Any = None):
        self.handle, self.peer, self.state, self.error = handle, peer, state, error
        self.nbytes, self.ndesc, self.tag = nbytes, ndesc, tag


class TransferBackend(Protocol):
    """What the engine needs from a one-sided transport."""

    name: str

    def register(self, regions: list[MemRegion]) -> None: ...
    def deregister_all(self) -> None: ...
    def metadata(self) -> bytes: ...
    def add_peer(self, md: bytes) -> str: ...
    def remove_peer(self, peer: str) -> None: ...
    def prep_descs(self, peer: str | None, descs: np.ndarray, mem: str) -> Any: ...
    def post_write(self, peer: str, src: np.ndarray, src_mem: str, dst: np.ndarray,
                   dst_mem: str, notif: bytes) -> Xfer: ...
    def post_prepped(self, peer: str, local: Any, local_idx: np.ndarray, remote: Any,
                     remote_idx: np.ndarray, notif: bytes) -> Xfer: ...
    def poll(self, x: Xfer) -> str: ...
    def abort(self, x: Xfer) -> bool: ...
    def notifications(self) -> dict[str, list[bytes]]: ...
    def send_notif(self, peer: str, msg: bytes) -> bool: ...
    def close(self) -> None: ...


def import_nixl():
    """The NIXL Python module: ``nixl_cu13`` if installed, else ``nixl_cu12``."""
    names = [os.environ["GLM53_NIXL_MODULE"]] if os.environ.get("GLM53_NIXL_MODULE") else [
        "nixl_cu13", "nixl_cu12"]
    errs = []
    for n in names:
        try:
            return importlib.import_module(n)
        except ImportError as e:  # pragma: no cover - depends on the host
            errs.append(f"{n}: {e}")
    raise ImportError("no NIXL module found (pip install nixl-cu12==1.5.1 or nixl-cu13==1.5.1): "
                      + "; ".join(errs))


def _as_descs(addr: np.ndarray, ln: np.ndarray, dev: int) -> np.ndarray:
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = ln
    out[:, 2] = dev
    return out


class NixlBackend:
    """NIXL agent with the UCX backend. Not thread-safe: the engine calls it from its one
    progress thread. The target of a write over UCX tcp must progress its worker: either NIXL's
    own progress thread does (``progress_thread=True``; it busy-polls a whole core, measured
    100% CPU on an idle 2-core VM) or the caller's loop does, through ``notifications()`` and
    ``poll()``, which progress the worker on each call.
    """

    def __init__(self, name: str, num_threads: int = 0, progress_thread: bool = False):
        nixl = import_nixl()
        self.module = nixl.__name__
        cfg = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"],
                                     num_threads=num_threads)
        self.agent = nixl.nixl_agent(name, cfg)
        if "UCX" not in self.agent.backends:
            raise BackendError("NIXL UCX backend plugin not available")
        self.name = name
        self._regs: list = []
        self._regions: list[MemRegion] = []
        self._dev: dict[str, int] = {}

    # -- memory ---------------------------------------------------------------------------
    def register(self, regions: list[MemRegion]) -> None:
        for r in regions:
            d = self.agent.register_memory([(r.addr, r.nbytes, r.device, "")], r.mem)
            self._regs.append(d)
            self._regions.append(r)

    def deregister_all(self) -> None:
        for d in self._regs:
            try:
                self.agent.deregister_memory(d)
            except Exception as e:  # pragma: no cover
                log.warning("deregister failed: %s", e)
        self._regs.clear()
        self._regions.clear()

    # -- peers ----------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, md: bytes) -> str:
        name = self.agent.add_remote_agent(md)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_peer(self, peer: str) -> None:
        try:
            self.agent.remove_remote_agent(peer)
        except Exception as e:
            log.debug("remove_remote_agent(%s): %s", peer, e)

    # -- transfers ------------------------------------------------------------------------
    def prep_descs(self, peer: str | None, descs: np.ndarray, mem: str):
        """A prepared descriptor list (Nx3 addr, len, dev); ``peer=None`` for the local side."""
        return self.agent.prep_xfer_dlist(peer or "NIXL_INIT_AGENT", descs, mem)

    def post_write(self, peer: str, src: np.ndarray, src_mem: str, dst: np.ndarray,
                   dst_mem: str, notif: bytes) -> Xfer:
        """One-shot WRITE of Nx3 descriptor arrays; the notification reaches ``peer`` after
        the data."""
        nbytes = int(src[:, 1].sum()) if src.size else 0
        try:
            l = self.agent.get_xfer_descs(src, src_mem)
            r = self.agent.get_xfer_descs(dst, dst_mem)
            h = self.agent.initialize_xfer("WRITE", l, r, peer, notif)
        except Exception as e:
            return Xfer(None, peer, ERR, f"initialize_xfer: {e}", nbytes, src.shape[0])
        return self._post(h, peer, nbytes, src.shape[0])

    def post_prepped(self, peer: str, local, local_idx: np.ndarray, remote,
                     remote_idx: np.ndarray, notif: bytes) -> Xfer:
        try:
            h = self.agent.make_prepped_xfer("WRITE", local, local_idx, remote, remote_idx, notif)
        except Exception as e:
            return Xfer(None, peer, ERR, f"make_prepped_xfer: {e}", 0, len(local_idx))
        return self._post(h, peer, 0, len(local_idx))

    def _post(self, h, peer, nbytes, ndesc) -> Xfer:
        try:
            st = self.agent.transfer(h)
        except Exception as e:
            self._release(h)
            return Xfer(None, peer, ERR, f"transfer: {e}", nbytes, ndesc)
        x = Xfer(h, peer, st, "" if st != ERR else "transfer returned ERR", nbytes, ndesc)
        if st != PROC:
            self._release(h)
            x.handle = None
        return x

    def poll(self, x: Xfer) -> str:
        if x.state != PROC:
            return x.state
        try:
            st = self.agent.check_xfer_state(x.handle)
        except Exception as e:
            st, x.error = ERR, f"check_xfer_state: {e}"
        if st != PROC:
            x.state = st
            if st == ERR and not x.error:
                x.error = "transfer failed"
            self._release(x.handle)
            x.handle = None
        return x.state

    def abort(self, x: Xfer) -> bool:
        """Cancel a transfer in flight. True when the handle is gone (cancelled or finished);
        False when NIXL could not cancel it yet (keep polling, then abort again)."""
        if x.handle is None:
            return True
        try:
            x.handle.release()
        except Exception as e:
            log.debug("release of in-flight transfer failed: %s", e)
            return False
        x.handle = None
        if x.state == PROC:
            x.state, x.error = ERR, "aborted"
        return True

    def _release(self, h) -> None:
        try:
            h.release()
        except Exception as e:  # pragma: no cover
            log.debug("release failed: %s", e)

    # -- notifications --------------------------------------------------------------------
    def notifications(self) -> dict[str, list[bytes]]:
        try:
            return self.agent.get_new_notifs()
        except Exception as e:  # pragma: no cover
            log.warning("get_new_notifs: %s", e)
            return {}

    def send_notif(self, peer: str, msg: bytes) -> bool:
        try:
            self.agent.send_notif(peer, msg)
            return True
        except Exception as e:
            log.debug("send_notif(%s): %s", peer, e)
            return False

    def close(self) -> None:
        self.deregister_all()
        self.agent = None  # the C++ agent is destroyed with its last reference
