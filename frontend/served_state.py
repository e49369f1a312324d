"""What a running frontend learns that the others must know: the LoRA adapters loaded or unloaded at run time.

The supervisor names a file in its run folder (FrontendConfig.state_path), shared by every frontend of the server
(--api-server-count) and by their successors after a restart. A frontend that loads or unloads an adapter changes
the file under a lock (read, change, write a temporary file renamed over it, so a frontend killed mid-write leaves
the previous version and two frontends changing it at once lose neither change) before it answers; the others read
it again when it changed (`StateFile.if_changed`, a stat per look) before they check a request's model, so an
adapter loaded through one frontend serves through all from the moment the load is answered. A frontend that starts
reads it back. The supervisor removes it with its run folder when the server stops. The served model's names
(--served-model-name) need no file: the supervisor hands every frontend it starts the same ones.
"""

from __future__ import annotations

import fcntl
import logging
import os

import msgspec

log = logging.getLogger(__name__)


class ServedState(msgspec.Struct, kw_only=True):
    """The adapters served now, by name (their folders): --lora-modules' as changed at run time."""

    adapters: dict[str, str] = {}


class StateFile:
    """The shared file at path (None: this frontend is on its own; nothing is kept)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None  # the version last read or written (_version)

    def load(self) -> ServedState | None:
        """What the frontends of this server wrote; None when nothing was (no run-time change yet) or it is
        unreadable (then logged: the start-up adapters are served)."""
        if self.path is None:
            return None
        try:
            with open(self.path, "rb") as f:
                self._seen = _version(os.fstat(f.fileno()))
                return msgspec.json.decode(f.read(), type=ServedState)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError) as e:
            log.error("frontend: the served state in %s is unreadable (%s); serving the start-up adapters only",
                      self.path, e)
            return None

    def if_changed(self) -> ServedState | None:
        """The state, when another frontend changed it since this one last read or wrote it; else None."""
        if self.path is None:
            return None
        try:
            version = _version(os.stat(self.path))
        except FileNotFoundError:
            return None
        return self.load() if version != self._seen else None

    def update(self, start: dict[str, str], name: str, folder: str) -> dict[str, str]:
        """Serve adapter `name` from folder (""): unload it) in the shared state, whose first version is `start`
        (--lora-modules'); returns the adapters served now."""
        if self.path is None:
            adapters = dict(start)
            _apply(adapters, name, folder)
            return adapters
        with open(f"{self.path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            current = self.load()
            adapters = dict(current.adapters) if current is not None else dict(start)
            _apply(adapters, name, folder)
            tmp = f"{self.path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(msgspec.json.encode(ServedState(adapters=adapters)))
            os.replace(tmp, self.path)
            self._seen = _version(os.stat(self.path))
        return adapters


def _apply(adapters: dict[str, str], name: str, folder: str) -> None:
    if folder:
        adapters[name] = folder
    else:
        adapters.pop(name, None)


def _version(st: os.stat_result) -> tuple[int, int, int]:
    """A file's version: a rename over it gives a new inode even within one tick of the file system's clock."""
    return st.st_mtime_ns, st.st_ino, st.st_size
