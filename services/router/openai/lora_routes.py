"""vLLM's run-time LoRA endpoints, on the router's HTTP server when it runs with
``--enable-lora --allow-runtime-lora-updating`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``;
behind ``--api-key`` like every route but ``/health``):

- ``POST /v1/load_lora_adapter`` ``{"lora_name": ..., "lora_path": ...}``: check the PEFT
  folder against the served model (``lora_registry.LoRARegistry.add``; a bad adapter is a 400
  naming the problem) and serve it as ``lora_name`` from now on. 200 with vLLM's plain-text
  answer ``Success: LoRA adapter '<name>' added successfully.``
- ``POST /v1/unload_lora_adapter`` ``{"lora_name": ...}``: stop serving it. Requests already
  running with it finish; new ones naming it get 404 (vLLM's behaviour). 200 with
  ``Success: LoRA adapter '<name>' removed successfully.``; 404 for an unknown name.

The workers load an adapter's weights when a request first names it, so loading costs the
engine nothing until then.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from services.common.lora import AdapterError
from services.router.lora_registry import LoRAExistsError, LoRARegistry
from services.router.openai import routes
from services.router.openai.errors import OpenAIError, bad_request
from services.router.openai.schema_check import check_body

log = logging.getLogger(__name__)


async def _fields(request: web.Request, names: tuple[str, ...], model) -> dict[str, str]:
    """The body's string fields ``names`` (other fields are ignored, as vLLM's
    ``load_inplace``), the body checked against ``model`` (``openai.schemas.misc``) first.

    Raises:
        OpenAIError: 400 a body that is not a JSON object, or a field missing or not a
            non-empty string.
    """
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        check_body(model, body)
    except OpenAIError as e:  # (vLLM's words first)
        raise bad_request(f"{' and '.join(repr(n) for n in names)} must be provided (non-empty "
                          f"strings): {e.message}", e.param) from None
    for name in names:
        if not (isinstance(body.get(name), str) and body[name]):
            raise bad_request(f"{' and '.join(repr(n) for n in names)} must be provided "
                              f"(non-empty strings): {name} is {body.get(name)!r}", name)
    return {name: body[name] for name in names}


class LoRARoutes:
    """The load / unload handlers over the router's adapter registry.

    Args:
        loras: the registry requests resolve their ``model`` against.
    """

    def __init__(self, loras: LoRARegistry) -> None:
        self.loras = loras

    def add_to(self, server) -> None:
        """Register both routes on ``server`` (``openai.http.OpenAIServer.add_route``, before
        it starts)."""
        server.add_route(routes.LOAD_LORA, self.load)
        server.add_route(routes.UNLOAD_LORA, self.unload)

    async def load(self, request: web.Request) -> web.Response:
        """POST /v1/load_lora_adapter."""
        body = await _fields(request, ("lora_name", "lora_path"), routes.LOAD_LORA.request)
        name, path = body["lora_name"], body["lora_path"]
        try:  # (file reads: on a thread, so the loop keeps streaming)
            lora = await asyncio.to_thread(self.loras.add, name, path)
        except LoRAExistsError as e:
            raise bad_request(str(e), "lora_name") from None
        except AdapterError as e:
            raise bad_request(f"cannot load LoRA adapter '{name}': {e}", "lora_path") from None
        log.info("LoRA adapter %r loaded from %s (id %d)", name, path, lora.lora_id)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        """POST /v1/unload_lora_adapter."""
        name = (await _fields(request, ("lora_name",), routes.UNLOAD_LORA.request))["lora_name"]
        try:
            self.loras.remove(name)
        except KeyError:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.",
                              param="lora_name", code="not_found") from None
        log.info("LoRA adapter %r unloaded (its running requests finish)", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
