"""`--port 0` and `--http-port 0` are chosen once, by the supervisor: a frontend it restarts binds the ports its clients
already know (an HTTP API that moved to another port at each restart would be lost to every client)."""

from __future__ import annotations

import json

from metrale.config import EngineArgs, ServeConfig
from metrale.supervisor import Supervisor


def test_a_restarted_frontend_is_given_the_same_free_ports(tiny_model_dir):
    sup = Supervisor(ServeConfig(engine=EngineArgs(model=str(tiny_model_dir("llama"))), port=0, http_port=0))
    try:
        fe = json.loads(sup.frontend.argv[-2])  # the argv every (re)start of frontend 0 runs
        assert fe["http_port"] not in (0, None) and fe["http_port"] == sup.config.http_port
        assert fe["client_address"].endswith(f":{sup.client_ports[0]}") and sup.client_ports[0] != 0
    finally:
        sup.stop()
