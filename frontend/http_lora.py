"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM serves them (only with
--allow-runtime-lora-updating, vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): an adapter loaded into a free LoRA slot of
every engine core, after the steps in flight, answers requests naming it as their model from then on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from metrale.lora_adapters import LoraError, read_adapter

from .frame_checks import Rejected
from .http_errors import ApiError
from .http_params import ServedModel, decode_body

if TYPE_CHECKING:
    from .server import FrontendServer


class LoadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's LoadLoRAAdapterRequest."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace an adapter of that name (vLLM's); refused otherwise


class UnloadLoraRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's UnloadLoRAAdapterRequest."""

    lora_name: str
    lora_int_id: int | None = None  # taken and ignored: the name is the key


class LoraAdmin:
    """The two handlers over one FrontendServer (whose adapters, the served model's, follow what they do)."""

    def __init__(self, server: FrontendServer, model: ServedModel) -> None:
        self.server = server
        self.model = model

    async def load(self, request: web.Request) -> web.Response:
        """Load an adapter; 400 naming what is wrong (a name taken, the folder, the engine core's refusal)."""
        body = await decode_body(request, LoadLoraRequest)
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise ApiError(400, "lora_name and lora_path must not be empty", param="lora_name", code="invalid_value")
        if name in self.model.names:
            raise ApiError(400, f"{name!r} is the served model's name", param="lora_name", code="invalid_value")
        if name in self.model.adapters:
            if not body.load_inplace:
                raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                               code="invalid_value")
            await self._update(name, "")
        try:
            read_adapter(path)
        except LoraError as e:
            raise ApiError(400, str(e), param="lora_path", code="invalid_value") from None
        await self._update(name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        """Unload an adapter; 404 for a name not loaded, 400 while requests run with it."""
        body = await decode_body(request, UnloadLoraRequest)
        name = body.lora_name
        if name not in self.model.adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
        await self._update(name, "")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _update(self, name: str, path: str) -> None:
        """The engine cores' load or unload; ApiError with their reason."""
        try:
            await self.server.update_lora(name, path)
        except Rejected as e:
            raise ApiError(503, e.message, type="server_error", code="not_ready") from None
        except RuntimeError as e:
            raise ApiError(400, str(e), param="lora_name", code="invalid_value") from None
