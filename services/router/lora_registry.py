"""The router's LoRA adapters (router ``--enable-lora``): name -> ``LoRARequest``, as vLLM's
serving models registry.

Adapters come from ``--lora-modules`` at start and from ``POST /v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` at run time (``--allow-runtime-lora-updating``). Each is checked
once, here, when it is added (``services.common.lora.check_adapter``: files, rank, target
modules, shapes against the served model), so a request naming it never meets a bad one. Ids
start at 1 and are never reused in the router's life, even after an unload: a later adapter
of the same name (maybe other weights at the same path) is a new id, so nothing cached for
the old one (the workers' weights, the prefix cache's blocks) is ever taken for it.

Unloading only removes the name: requests already running keep their ``LoRARequest`` and
finish (vLLM's behaviour); new requests naming it are refused (404) from then on.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from services.common.lora import AdapterError, AdapterInfo, LoRARequest, check_adapter

# an adapter's name: what a request's ``model`` names and a metric label carries (vLLM has no
# limit; a 100,000-character name was accepted and became a label)
MAX_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""

    name: str
    path: str
    base_model_name: str | None = None

    def as_flag_value(self) -> str:
        """The entry as ``pagedserve serve`` forwards it (the form it was given in)."""
        if self.base_model_name is None:
            return f"{self.name}={self.path}"
        return json.dumps({"name": self.name, "path": self.path,
                           "base_model_name": self.base_model_name}, separators=(",", ":"))

    def __str__(self) -> str:
        return self.as_flag_value()


def lora_module(value: str) -> LoRAModule:
    """argparse type of ``--lora-modules``: ``name=path`` or a JSON object with ``name`` and
    ``path`` (and optionally ``base_model_name``).

    Raises:
        argparse.ArgumentTypeError: neither form, or an empty name or path.
    """
    if value.lstrip().startswith("{"):
        try:
            obj = json.loads(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
        unknown = set(obj) - {"name", "path", "base_model_name"} if isinstance(obj, dict) else ()
        if not isinstance(obj, dict) or unknown:
            raise argparse.ArgumentTypeError(
                f"a JSON entry is an object with name, path and optionally base_model_name"
                f"{f'; unknown field {sorted(unknown)[0]!r}' if unknown else ''}")
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError("base_model_name must be a string")
    else:
        name, sep, path = value.partition("=")
        base = None
        if not sep:
            raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {value!r}")
    if not (isinstance(name, str) and name and isinstance(path, str) and path):
        raise argparse.ArgumentTypeError(f"an adapter needs a non-empty name and path: {value!r}")
    return LoRAModule(name, path, base)


class LoRAExistsError(ValueError):
    """An adapter of that name is already loaded."""


class LoRARegistry:
    """The adapters this router serves, in load order.

    Args:
        model_config: returns the served model's config dict (called once, at the first
            add; ``services.common.lora.model_config_of``).
        max_lora_rank: ``--max-lora-rank``: adapters of a higher rank are refused.
        base_names: names that stay the base model's (``--served-model-name`` values and the
            engine's name): no adapter may take one.
    """

    def __init__(self, model_config: Callable[[], dict], max_lora_rank: int,
                 base_names: Callable[[], tuple[str, ...]] = tuple):
        self._model_config = model_config
        self._config: dict | None = None
        self.max_lora_rank = max_lora_rank
        self._base_names = base_names
        self._adapters: dict[str, LoRARequest] = {}
        self._parents: dict[str, str | None] = {}
        self._last_id = 0
        self._lock = threading.Lock()  # add may run on a thread (the HTTP load endpoint)

    def __len__(self) -> int:
        return len(self._adapters)

    def __iter__(self) -> Iterator[LoRARequest]:
        """The adapters in load order."""
        return iter(list(self._adapters.values()))

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter named ``name``, or None."""
        return self._adapters.get(name) if name else None

    def parent(self, name: str) -> str | None:
        """The ``base_model_name`` an entry gave for adapter ``name`` (None: the served
        model)."""
        return self._parents.get(name)

    def check(self, path: str) -> AdapterInfo:
        """``check_adapter`` of ``path`` against the served model (blocking file reads).

        Raises:
            AdapterError: naming the problem.
        """
        if self._config is None:  # (two threads may both read it: the same dict)
            try:
                self._config = self._model_config()
            except (OSError, ValueError, KeyError) as e:
                raise AdapterError(f"cannot read the served model's config to check "
                                   f"adapters: {e}") from None
        return check_adapter(path, self._config, self.max_lora_rank)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter at ``path`` and serve it as ``name`` under the next id (blocking
        file reads: call it on a thread from the event loop; thread-safe).

        Raises:
            LoRAExistsError: ``name`` is already an adapter.
            AdapterError: an empty name, one over ``MAX_NAME_CHARS`` or with control
                characters, a base model's name, or a bad adapter (naming the
                problem).
        """
        if not name:
            raise AdapterError("lora_name must not be empty")
        if len(name) > MAX_NAME_CHARS or not name.isprintable():
            raise AdapterError(f"lora_name must be at most {MAX_NAME_CHARS} printable "
                               f"characters, got {len(name)}")
        if name in self._adapters:
            raise LoRAExistsError(f"The lora adapter '{name}' has already been loaded.")
        if name in self._base_names():
            raise AdapterError(f"lora_name '{name}' is the base model's name")
        self.check(path)
        with self._lock:
            if name in self._adapters:  # (added meanwhile, while check ran on a thread)
                raise LoRAExistsError(f"The lora adapter '{name}' has already been loaded.")
            self._last_id += 1
            lora = self._adapters[name] = LoRARequest(self._last_id, name, path)
            self._parents[name] = base_model_name
        return lora

    def remove(self, name: str) -> LoRARequest:
        """Stop serving adapter ``name`` (running requests keep theirs and finish).

        Raises:
            KeyError: no adapter of that name.
        """
        lora = self._adapters.pop(name)
        self._parents.pop(name, None)
        return lora


def registry_from_args(args, base_names: Callable[[], tuple[str, ...]]) -> LoRARegistry | None:
    """The registry the router flags ask for (None without ``--enable-lora``), holding every
    ``--lora-modules`` entry (checked now, against ``--model``'s config).

    Raises:
        ValueError: ``--lora-modules`` or ``--allow-runtime-lora-updating`` without
            ``--enable-lora``, or a bad ``--lora-modules`` entry (naming it and the problem).
    """
    modules = args.lora_modules or []
    if not args.enable_lora:
        if modules or args.allow_runtime_lora_updating:
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need "
                             "--enable-lora")
        return None
    from services.common.lora import model_config_of
    from services.common.model_files import resolve_model

    def model_config() -> dict:
        source = resolve_model(args.model)
        return model_config_of(source.path, source.is_gguf)

    registry = LoRARegistry(model_config, args.max_lora_rank, base_names)
    for m in modules:
        try:
            registry.add(m.name, m.path, m.base_model_name)
        except ValueError as e:  # (AdapterError, LoRAExistsError)
            raise ValueError(f"--lora-modules {m}: {e}") from None
    return registry
