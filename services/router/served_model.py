"""The names the router serves its model under (router ``--served-model-name``, vLLM's flag).

Without names the model is called what the engine reports (``GetEngineInfoResponse.model``:
the model folder's or GGUF file's name). With names, the first is the one reported
everywhere (OpenAI's ``/v1/models`` and every response's ``model``, gRPC ``ListModels``) and a
request's ``model`` may be any of them (the engine's own name is then not accepted, as vLLM).

With router ``--enable-lora`` a request's ``model`` may also name a LoRA adapter of the
registry (``lora_registry.py``): it then runs with that adapter, and its responses carry the
adapter's name as their ``model`` (as vLLM's).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import engine_pb2
from services.router.lora_registry import LoRARegistry
from services.router.validation import RequestError


class ServedModel:
    """The served names of the model.

    Args:
        names: ``--served-model-name`` values (none: the engine's name).
        loras: the LoRA adapters (router ``--enable-lora``), or None.

    Raises:
        ValueError: an empty name or a name given twice.
    """

    def __init__(self, names: Sequence[str] = (), loras: LoRARegistry | None = None):
        names = tuple(names)
        if any(not n for n in names):
            raise ValueError("--served-model-name: a name must not be empty")
        if len(set(names)) != len(names):
            raise ValueError(f"--served-model-name: a name is given twice: {list(names)}")
        self.names = names
        self.loras = loras
        self._source: engine_pb2.GetEngineInfoResponse | None = None
        self._renamed: engine_pb2.GetEngineInfoResponse | None = None

    def info(self, info: engine_pb2.GetEngineInfoResponse) -> engine_pb2.GetEngineInfoResponse:
        """``info`` with ``model`` set to the reported name (a copy, made once per engine info
        object; ``info`` itself without names)."""
        if not self.names:
            return info
        if self._source is not info:
            renamed = engine_pb2.GetEngineInfoResponse()
            renamed.CopyFrom(info)
            renamed.model = self.names[0]
            self._source, self._renamed = info, renamed
        assert self._renamed is not None
        return self._renamed

    def accepts(self, model: str | None, info: engine_pb2.GetEngineInfoResponse) -> bool:
        """Whether a request's ``model`` names the base model: absent or empty, one of the
        served names, or (without names) the engine's name (``info.model``)."""
        return not model or model in (self.names or (info.model,))

    def resolve(self, model: str | None, info: engine_pb2.GetEngineInfoResponse
                ) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, or None for the base model.

        Raises:
            RequestError: NOT_FOUND, ``The model `<model>` does not exist.``: neither.
        """
        if self.accepts(model, info):
            return None
        lora = self.loras.get(model) if self.loras is not None else None
        if lora is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"The model `{model}` does not exist.",
                               "model")
        return lora

    def adapters(self, info: engine_pb2.GetEngineInfoResponse
                 ) -> list[tuple[LoRARequest, str]]:
        """The LoRA adapters in load order, each with its parent: the ``base_model_name``
        its ``--lora-modules`` entry gave, else the base model's reported name (``info``:
        as ``info()`` returns it)."""
        if self.loras is None:
            return []
        return [(lora, self.loras.parent(lora.name) or info.model) for lora in self.loras]

    @staticmethod
    def for_adapter(info: engine_pb2.GetEngineInfoResponse, lora: LoRARequest | None
                    ) -> engine_pb2.GetEngineInfoResponse:
        """``info`` as a request of ``lora`` sees it: ``model`` its name (a copy), else
        ``info`` itself."""
        if lora is None:
            return info
        renamed = engine_pb2.GetEngineInfoResponse()
        renamed.CopyFrom(info)
        renamed.model = lora.name
        return renamed
