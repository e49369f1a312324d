"""The frontend child of `metrale serve`: `python -m metrale.frontend_process CONFIG_JSON HEALTH_PATH`.

Its configuration comes as JSON from the supervisor, its health from the supervisor's health file; its event loop
beats the heartbeat the supervisor watches (metrale/frontend_heartbeat.py); it ends itself when the supervisor is
gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import msgspec

from metrale.frontend_heartbeat import HEARTBEAT_ENV, Heartbeat
from metrale.health_file import read_health
from metrale.ipc.messages import Health

API_KEY_ENV = "METRALE_API_KEY"  # how the supervisor hands the frontend --api-key


def _run_frontend(config_json: str, health_path: str) -> None:
    """The frontend child: its config from JSON, health from the supervisor's file; exits with its parent."""
    from metrale.frontend.server import FrontendConfig, main

    logging.basicConfig(level=logging.INFO, format="%(asctime)s frontend %(levelname)s %(message)s")
    config = msgspec.json.decode(config_json, type=FrontendConfig)
    config.api_key = os.environ.get(API_KEY_ENV) or None  # --api-key comes in the environment, never in argv
    supervisor = int(os.environ.get("METRALE_SUPERVISOR_PID", os.getppid()))

    def health() -> Health:
        try:
            return read_health(health_path)
        except (OSError, msgspec.DecodeError):
            return Health(id="", healthy=False, last_fault="the supervisor's health file is unreadable")

    def watch_parent() -> None:
        while True:
            time.sleep(0.5)  # a poll interval, not synchronisation: nothing waits on it
            if not _pid_alive(supervisor):
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch_parent, daemon=True).start()
    beat_path = os.environ.get(HEARTBEAT_ENV)  # the supervisor's hang watch reads it
    main(config, health_source=health, heartbeat=Heartbeat(beat_path) if beat_path else None)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


if __name__ == "__main__":
    if len(sys.argv) == 3:
        _run_frontend(sys.argv[1], sys.argv[2])
    else:
        sys.exit("usage: python -m metrale.frontend_process CONFIG_JSON HEALTH_PATH")
