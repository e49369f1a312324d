"""metrale's shared-memory segments: their names, opening and releasing them, and sweeping what dead owners left.

Segment names are "metrale-<owner pid>-<token>" with mode 0600, so a supervisor can sweep what a dead
owner left in /dev/shm (sweep_orphans) and nobody else can read the plans. Doorbell sockets follow the
same naming, so one sweep removes both.
"""

from __future__ import annotations

import os
import secrets
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import psutil

SEGMENT_PREFIX = "metrale-"
SHM_DIR = "/dev/shm"


def segment_name(owner_pid: int, token: str | None = None) -> str:
    """The segment name for an owner pid: "metrale-<pid>-<token>" (a random token by default)."""
    return f"{SEGMENT_PREFIX}{owner_pid}-{token or secrets.token_hex(6)}"


def owner_pid_of(name: str) -> int | None:
    """The owner pid encoded in a segment (or doorbell) name; None if the name is not ours."""
    if not name.startswith(SEGMENT_PREFIX):
        return None
    pid, _, rest = name[len(SEGMENT_PREFIX) :].partition("-")
    return int(pid) if pid.isdigit() and rest else None


def attach_untracked(name: str) -> SharedMemory:
    """Open an existing segment so that this process's exit never unlinks it."""
    if sys.version_info >= (3, 13):
        return SharedMemory(name=name, track=False)
    shm = SharedMemory(name=name)
    # Before 3.13 attaching registers the segment with this process's resource_tracker, which
    # would unlink it when we exit. The owner's own process registered it already (a set): leave it.
    if owner_pid_of(name) != os.getpid():
        resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def release(shm: SharedMemory, seqs: memoryview | None, owner: bool) -> None:
    """Unmap a segment (and unlink it if we own it), even while numpy views of it are still alive."""
    if seqs is not None:
        try:
            seqs.release()
        except BufferError:
            pass
    try:
        shm.close()
    except BufferError:
        # A caller still holds views (a plan being executed): the mapping lives on until they
        # die; forget it here so that SharedMemory.__del__ does not try again.
        shm._buf = shm._mmap = None
        if shm._fd >= 0:
            os.close(shm._fd)
            shm._fd = -1
    if owner:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass  # swept already


# ---- sweeping leftovers ----------------------------------------------------------------------


def sweep_segments(owner_pids: set[int] | list[int], shm_dir: str = SHM_DIR) -> list[str]:
    """Remove every metrale segment (and doorbell socket) in shm_dir owned by one of these pids."""
    pids = set(owner_pids)
    return _sweep(shm_dir, lambda pid, path: pid in pids)


def sweep_orphans(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove every metrale segment (and doorbell socket) in shm_dir whose owner process is gone."""
    return _sweep(shm_dir, lambda pid, path: not _owner_alive(pid, path))


def _sweep(shm_dir: str, doomed) -> list[str]:
    """Unlink the entries of shm_dir named for an owner pid that doomed(pid, path) selects."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        pid = owner_pid_of(name)
        path = os.path.join(shm_dir, name)
        if pid is not None and doomed(pid, path):
            try:
                os.unlink(path)
                removed.append(name)
            except FileNotFoundError:
                pass  # its owner (or another sweeper) got there first
    return removed


def _owner_alive(pid: int, path: str) -> bool:
    """Whether the process that created path still runs (a zombie, or a reused pid, does not count)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        created = proc.create_time()
        born = os.stat(path).st_mtime  # the segment's ftruncate, shortly after its owner started
    except (psutil.NoSuchProcess, FileNotFoundError):
        return False
    except psutil.AccessDenied:
        return True
    return created <= born + 1.0  # a process born after the segment is a reused pid
