"""The worker's two failures that decide what a tensor-parallel rank does next (no torch here: the worker loop
imports them before any runner is built)."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan the runner refuses before anything runs: every rank of a group refuses it alike, so it is that
    step's error and the worker serves on."""


class GroupLost(RuntimeError):
    """A collective failed or a rank's step failed past its checks: a peer is gone or cannot follow, so the
    group cannot go on (the rank exits; the supervisor restarts the whole group)."""
