"""GET /v1/models and GET /v1/models/{id}: the model cards of the one model this server serves, once per name, and of
each LoRA adapter it serves (--lora-modules), its parent the model."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from aiohttp import web

from .http_errors import ApiError, json_response
from .http_params import ServedModel

if TYPE_CHECKING:
    from .server import FrontendServer


class Models:
    """The /v1/models handlers over one FrontendServer."""

    def __init__(self, server: FrontendServer, model: ServedModel) -> None:
        self.server = server
        self.model = model
        self.created = int(time.time())

    async def list(self, request: web.Request) -> web.Response:
        """GET /v1/models: a card per served name (503 until an engine core can serve)."""
        self._check_ready()
        cards = [self._card(name) for name in (*self.model.names, *self.model.adapters)]
        return json_response({"object": "list", "data": cards})

    async def retrieve(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the card of that name (the model folder's path too, when it names the model); 404
        saying it does not exist otherwise."""
        name = request.match_info["id"]
        if name not in self.model.names and name not in self.model.adapters \
                and not (self.model.dir_named and name == str(self.model.dir)):
            raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        self._check_ready()
        return json_response(self._card(name))

    def _card(self, name: str) -> dict:
        adapter = name in self.model.adapters
        return {"id": name, "object": "model", "created": self.created, "owned_by": "metrale",
                "root": self.model.adapters[name] if adapter else str(self.model.dir),
                "parent": self.model.id if adapter else None, "max_model_len": self.server.max_model_len}

    def _check_ready(self) -> None:
        """503 until an engine core can serve (its max_model_len is not known before)."""
        health = self.server.health()
        if not health.ready:
            raise ApiError(503, f"not ready: waiting for {health.waiting_for}", type="server_error", code="not_ready")
