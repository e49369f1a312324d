"""HttpApi: the OpenAI-compatible HTTP API, served by aiohttp on the frontend's own event loop.

Routes: POST /v1/completions (http_completions.py), POST /v1/chat/completions (http_chat.py), POST /v1/responses
(http_responses.py, run through the chat route), each as SSE streams or one JSON answer; POST /v1/embeddings
(http_embeddings.py); GET /v1/models[/{id}]
(http_models.py); POST /tokenize, /detokenize (http_tokenize.py); GET|POST /ping, POST /invocations
(http_sagemaker.py); GET /health, /metrics, /version, /load (here). docs/http.md is the reference.

Every choice of a request is one FrontendServer.generate_local request (http_run.py): the same validation,
tokenization, AddRequest, detokenization (stop strings included) and abort path that a ZMQ Generate frame takes.
An HTTP request answers with an error status only before its first byte of body: the handler waits for each
choice's first output (or Error) before it starts the response, so "busy" (503), "too_long" (400) and bad
parameters become HTTP errors (http_errors.py); an error after that ends the stream with an `error` event. A
client that closes its connection cancels the handler (aiohttp's handler_cancellation), whose `finally` aborts
what still runs in the engine.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from .api_key import UNAUTHORIZED_MESSAGE
from .api_servers import ProcessSite, others_families
from .http_chat import ChatCompletions
from .http_completions import Completions
from .http_embeddings import Embeddings
from .http_lora import LoraAdmin
from .http_access_log import access_log
from .http_errors import ApiError, errors_as_json, json_response
from .http_models import Models
from .http_params import ServedModel
from .http_reply import TokenTexts
from .http_responses import Responses
from .http_resume import request_ids
from .http_sagemaker import SageMaker
from .http_tokenize import Tokenization
from .metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from .server import FrontendServer

log = logging.getLogger(__name__)

_STATS_ON_SCRAPE_S = 1.0  # how long /metrics waits for the engine core's counters before using the last ones
_SHUTDOWN_S = 1.0  # open streams get this long to end when the server stops
_LINGER_S = 2.0  # after an answer sent before its body was read (408, 413), how long the rest is read and dropped
# What a load balancer, an orchestrator or a scraper probes without the key (as vLLM leaves /health and /metrics open).
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})


class HttpApi:
    """The OpenAI-compatible routes over one FrontendServer."""

    def __init__(self, server: FrontendServer) -> None:
        self.server = server
        cfg = server.config
        self.model = ServedModel(names=tuple(server.model_names), dir=cfg.model_dir,
                                 dir_named=not cfg.served_model_names, sampling_defaults=server.sampling_defaults,
                                 force_usage=cfg.enable_force_include_usage,
                                 per_request_metrics=cfg.enable_per_request_metrics,
                                 tokens_as_token_ids=cfg.return_tokens_as_token_ids,
                                 adapters=server.adapters)
        texts = TokenTexts(server.tokenizer)
        self.completions = Completions(server, self.model, texts)
        self.chat = ChatCompletions(server, self.model, texts)
        responses = Responses(self.chat, self.model, texts)
        models = Models(server, self.model)
        embeddings = Embeddings(server, self.model)
        tokenization = Tokenization(server, self.model, self.chat)
        sagemaker = SageMaker(self)
        middlewares = [access_log] if cfg.log_requests else []  # outermost: it sees the status errors_as_json sends
        if cfg.api_server_count > 1:  # a request sees the adapters another frontend loaded
            middlewares.append(self._shared_state)
        self.app = web.Application(middlewares=[*middlewares, errors_as_json, self._require_key, self._body_in_time,
                                                request_ids],
                                   client_max_size=cfg.max_frame_bytes)
        self.app.add_routes([
            web.post("/v1/completions", self.completions.handle),
            web.post("/v1/chat/completions", self.chat.handle),
            web.post("/v1/responses", responses.handle),
            web.post("/v1/embeddings", embeddings.handle),
            web.get("/v1/models", models.list),
            web.get("/v1/models/{id:.+}", models.retrieve),  # an id may be a folder's path, slashes and all
            web.post("/tokenize", tokenization.tokenize),
            web.post("/detokenize", tokenization.detokenize),
            web.get("/ping", sagemaker.ping),
            web.post("/ping", sagemaker.ping),
            web.post("/invocations", sagemaker.invocations),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics),
            web.get("/version", self.version),
            web.get("/load", self.load),
        ])
        if cfg.allow_runtime_lora_updating:
            lora = LoraAdmin(server, self.model)
            self.app.add_routes([web.post("/v1/load_lora_adapter", lora.load),
                                 web.post("/v1/unload_lora_adapter", lora.unload)])
        self._runner: web.AppRunner | None = None
        # With several frontends: this one's counters, for the one a scrape reaches.
        self._process_site = ProcessSite(server.metrics, cfg.api_server_sockets[cfg.api_server_index]) \
            if cfg.api_server_sockets else None

    @web.middleware
    async def _shared_state(self, request: web.Request, handler) -> web.StreamResponse:
        """Several frontends: serve what another loaded or unloaded (served_state.py) before the request is read."""
        self.server.refresh_adapters()
        return await handler(request)

    @web.middleware
    async def _require_key(self, request: web.Request, handler) -> web.StreamResponse:
        """--api-key: every route but the probes (OPEN_PATHS) answers 401 without `Authorization: Bearer KEY` —
        a route that runs the model or the tokenizer (/invocations, /tokenize) is as closed as /v1/*."""
        if request.path not in OPEN_PATHS and not self.server.api_key.allows_header(request.headers.get("Authorization")):
            raise ApiError(401, UNAUTHORIZED_MESSAGE, code="invalid_api_key")
        return await handler(request)

    @web.middleware
    async def _body_in_time(self, request: web.Request, handler) -> web.StreamResponse:
        """A body that does not arrive whole within http_body_timeout_s is a 408 (a client trickling its body
        would hold the connection and its handler forever); the handler reads the body aiohttp kept."""
        limit = self.server.config.max_frame_bytes
        if request.content_length is not None and request.content_length > limit:  # refused before a byte is read
            resp = ApiError(413, f"the request body ({request.content_length} bytes) is over the limit of {limit} bytes "
                            "(--max-frame-bytes)", code="request_too_large").response()
            resp.force_close()
            return resp
        if request.body_exists:
            try:
                async with asyncio.timeout(self.server.config.http_body_timeout_s):
                    await request.read()
            except TimeoutError:
                resp = ApiError(408, f"the request body did not arrive within {self.server.config.http_body_timeout_s:g} s",
                                type="timeout_error", code="request_timeout").response()
                resp.force_close()  # the rest of that body must not be read as the next request
                return resp
        return await handler(request)

    async def start(self, host: str, port: int) -> str:
        """Listen on host:port (0: any free port); return the base URL. Several frontends (--api-server-count) share
        the port: each binds it with SO_REUSEPORT and the kernel spreads the connections over them."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=_SHUTDOWN_S, keepalive_timeout=self.server.config.http_idle_timeout_s,
                                     lingering_time=_LINGER_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_port=self.server.config.api_server_count > 1 or None)
        await site.start()
        if self._process_site is not None:
            await self._process_site.start()
        bound = self._runner.addresses[0]
        url = f"http://{host}:{bound[1]}"
        log.info("frontend: OpenAI-compatible HTTP API on %s", url)
        return url

    async def stop(self) -> None:
        """Stop listening and end open requests."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._process_site is not None:
            await self._process_site.stop()

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: 200 when every process is up, else 503; the body says which."""
        health = self.server.health()
        body = msgspec.to_builtins(health)
        body.pop("id", None)
        body.pop("type", None)
        return json_response(body, status=200 if health.healthy else 503)

    async def version(self, request: web.Request) -> web.Response:
        """GET /version: {"version"} of the metrale package."""
        return json_response({"version": importlib.metadata.version("metrale")})

    async def load(self, request: web.Request) -> web.Response:
        """GET /load: {"server_load"}, the requests running now (vLLM's load figure)."""
        return json_response({"server_load": self.server.requests.num_live})

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text; engine gauges asked for now (the last ones if it does not answer); with
        several frontends, their own counters summed (api_servers.py)."""
        collector = self.server.metrics.engine
        try:
            collector.update(stats=await self.server.engine_stats(_STATS_ON_SCRAPE_S))
        except Exception as exc:  # not up, or slow: serve the last snapshot
            log.debug("frontend: /metrics without fresh engine stats: %s", exc)
        collector.update(health=self.server.health())
        cfg = self.server.config
        others = await others_families(cfg.api_server_sockets, cfg.api_server_index, _STATS_ON_SCRAPE_S) \
            if cfg.api_server_sockets else None
        return web.Response(body=self.server.metrics.render(others), headers={"Content-Type": CONTENT_TYPE})
