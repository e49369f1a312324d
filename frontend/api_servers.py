"""The frontends of one server (--api-server-count) as one of them sees the others: each serves its own counters and
histograms on a private socket in the supervisor's run folder (FrontendConfig.api_server_sockets), and the one a
scrape of /metrics reaches asks every other for them and sums them with its own (metrics.py).

A Unix socket in the run folder (the supervisor's, mode 0700) rather than a port: nothing outside the server reaches
it, and a restarted frontend takes its index's path again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from .metrics import Metrics

log = logging.getLogger(__name__)

PROCESS_METRICS_PATH = "/process/metrics"


class WireSample(msgspec.Struct, array_like=True):
    name: str
    labels: dict[str, str]
    value: float


class WireFamily(msgspec.Struct, array_like=True):
    """One metric family of one frontend, as it travels to the one summing them."""

    name: str
    documentation: str
    type: str
    samples: list[WireSample]


class ProcessSite:
    """This frontend's private HTTP site: its own metric families (PROCESS_METRICS_PATH), as JSON."""

    def __init__(self, metrics: Metrics, path: str) -> None:
        self.metrics = metrics
        self.path = path
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listen on the socket (a predecessor's, left by its death, is replaced)."""
        app = web.Application()
        app.router.add_get(PROCESS_METRICS_PATH, self._own)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        await web.UnixSite(self._runner, self.path).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _own(self, request: web.Request) -> web.Response:
        families = [WireFamily(f.name, f.documentation, f.type,
                               [WireSample(s.name, s.labels, s.value) for s in f.samples])
                    for f in self.metrics.own_families()]
        return web.Response(body=msgspec.json.encode(families), content_type="application/json")


async def others_families(sockets: list[str], me: int, timeout_s: float) -> list[list[Metric]]:
    """Every other frontend's own metric families; one that does not answer within timeout_s (down, restarting) is
    left out."""

    async def ask(path: str) -> list[Metric] | None:
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path),
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
                async with session.get(f"http://frontend{PROCESS_METRICS_PATH}") as resp:
                    wire = msgspec.json.decode(await resp.read(), type=list[WireFamily])
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, msgspec.DecodeError) as e:
            log.debug("frontend: no counters from the frontend at %s: %r", path, e)
            return None
        families = []
        for w in wire:
            family = Metric(w.name, w.documentation, w.type)
            family.samples = [Sample(s.name, s.labels, s.value) for s in w.samples]
            families.append(family)
        return families

    got = await asyncio.gather(*(ask(path) for i, path in enumerate(sockets) if i != me))
    return [families for families in got if families is not None]
