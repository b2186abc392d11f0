"""The names the router serves its model under (router ``--served-model-name``, vLLM's flag).

Without names the model is called what the engine reports (``GetEngineInfoResponse.model``:
the model folder's or GGUF file's name). With names, the first is the one reported
everywhere (OpenAI's ``/v1/models`` and every response's ``model``, gRPC ``ListModels``) and a
request's ``model`` may be any of them (the engine's own name is then not accepted, as vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.common.pb.pagedserve.v1 import engine_pb2


class ServedModel:
    """The served names of the model.

    Args:
        names: ``--served-model-name`` values (none: the engine's name).

    Raises:
        ValueError: an empty name or a name given twice.
    """

    def __init__(self, names: Sequence[str] = ()):
        names = tuple(names)
        if any(not n for n in names):
            raise ValueError("--served-model-name: a name must not be empty")
        if len(set(names)) != len(names):
            raise ValueError(f"--served-model-name: a name is given twice: {list(names)}")
        self.names = names
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
        """Whether a request's ``model`` names this model: absent or empty, one of the served
        names, or (without names) the engine's name (``info.model``)."""
        return not model or model in (self.names or (info.model,))
