"""Which frontend an engine request id belongs to, when several serve one engine core (--api-server-count).

Every id a frontend sends an engine core (a request's, a stats or LoRA question's) opens with that frontend's prefix
and a "-": "<token>-<n>" for frontend 0, "<token>.<i>-<n>" for frontend i > 0. The token is fresh for each start of
the process (a restarted frontend's ids never collide with its predecessor's); the index says where the engine core
sends what answers the id, so it routes without a table and a restarted frontend's probe finds its way before the
engine core has heard of it.
"""

from __future__ import annotations

import secrets


def new_prefix(frontend: int) -> str:
    """A fresh prefix for the ids of frontend `frontend` (frontend 0's carries no index, as with one frontend)."""
    token = secrets.token_hex(4)
    return token if frontend == 0 else f"{token}.{frontend}"


def frontend_of_prefix(prefix: str) -> int:
    """The frontend whose prefix this is; 0 for one that names none (or names it badly)."""
    dot = prefix.rfind(".")
    if dot < 0:
        return 0
    try:
        return int(prefix[dot + 1:])
    except ValueError:
        return 0


def prefix_of(request_id: str) -> str:
    """The prefix an id opens with (the whole id when it has no "-")."""
    return request_id.partition("-")[0]


def frontend_name(index: int) -> str:
    """Frontend index's process name: "frontend", "frontend 1", ... (health, status, logs, the status channel)."""
    return f"frontend {index}" if index else "frontend"
