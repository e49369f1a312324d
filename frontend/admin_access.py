"""Who may send an admin request (worker kill / restart): nobody unless `--enable-admin`, and then only a peer on
this machine (a loopback TCP address, or an ipc:// connection) unless `--admin-allow-remote`. The API key, when
the server has one, is checked before this like for every request."""

from __future__ import annotations

import ipaddress

import zmq


def peer_address(frame: zmq.Frame) -> str | None:
    """The address of the peer a frame came from ("127.0.0.1" over TCP), when libzmq tells."""
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError, ValueError):
        return None


def is_loopback(peer: str | None, transport: str) -> bool:
    """Whether a peer is on this machine: a loopback IP over TCP, anyone over ipc:// or inproc://."""
    if not transport.startswith("tcp://"):
        return True
    try:
        return peer is not None and ipaddress.ip_address(peer.strip("[]")).is_loopback
    except ValueError:
        return False


def admin_refusal(enabled: bool, allow_remote: bool, peer: str | None, transport: str) -> str | None:
    """Why an admin request from peer is refused (an admin_disabled error), or None when it may run."""
    if not enabled:
        return "admin requests are off: start the server with --enable-admin (for fault tests; never on a shared box)"
    if not allow_remote and not is_loopback(peer, transport):
        return (f"admin requests are taken from this machine only (the peer is {peer or 'unknown'}); "
                "start the server with --admin-allow-remote to allow others")
    return None
