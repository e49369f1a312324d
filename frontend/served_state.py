"""What a running frontend learns that a restarted one must know: the LoRA adapters loaded or unloaded at run time.

The supervisor names a file in its run folder (FrontendConfig.state_path); the frontend rewrites it whole (a
temporary file renamed over it, so a frontend killed mid-write leaves the previous version) after each change, and a
frontend that starts reads it back. The supervisor removes it with its run folder when the server stops. The served
model's names (--served-model-name) need no file: the supervisor hands every frontend it starts the same ones.
"""

from __future__ import annotations

import logging
import os

import msgspec

log = logging.getLogger(__name__)


class ServedState(msgspec.Struct, kw_only=True):
    """The adapters served now, by name (their folders): --lora-modules' as changed at run time."""

    adapters: dict[str, str] = {}


def load_state(path: str | None) -> ServedState | None:
    """What an earlier frontend of this server wrote; None when there is none (the first frontend) or it is
    unreadable (then logged: the start-up adapters are served)."""
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=ServedState)
    except (OSError, msgspec.DecodeError) as e:
        log.error("frontend: the state an earlier frontend left in %s is unreadable (%s); serving the start-up "
                  "adapters only", path, e)
        return None


def save_state(path: str | None, state: ServedState) -> None:
    """Write state for the next frontend, atomically."""
    if path is None:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(state))
    os.replace(tmp, path)
