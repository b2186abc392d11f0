"""``--kv-events-config``: the scheduler's KV events (``kv_events.py``), vLLM's JSON and field
names (``KVEventsConfig``).

JSON object fields:

- ``enable_kv_cache_events``: publish the prefix cache's changes (default false: no events,
  no cost). The gRPC stream (``EngineService.SubscribeKvEvents``) is served whenever this is
  true; needs prefix caching.
- ``publisher``: ``"zmq"`` (also a ZMQ PUB socket, vLLM's wire format: ``kv_events_zmq.py``)
  or ``"null"`` (the gRPC stream only); default ``"zmq"`` when events are on, as in vLLM.
- ``endpoint``: the ZMQ PUB address, bound when it holds ``*`` / ``::`` or is ``ipc://`` /
  ``inproc://``, else connected (vLLM's rule); default ``"tcp://*:5557"``.
- ``replay_endpoint``: the ZMQ ROUTER address that replays buffered batches (bound); default
  none (no replay socket).
- ``buffer_steps``: batches kept for replay (ZMQ and gRPC); default 10000.
- ``hwm``: the PUB socket's high-water mark (messages; 0 = none); default 100000.
- ``max_queue_size``: batches queued for the ZMQ thread, and for each gRPC subscriber (one
  that falls this far behind is cut off); default 100000.
- ``topic``: the ZMQ topic frame; default ``""``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any

from services.common.config import field_default, json_flag_object

FLAG = "--kv-events-config"
PUBLISHERS = ("zmq", "null")
_FIELDS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint",
           "buffer_steps", "hwm", "max_queue_size", "topic")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Validated KV event settings (see the module docstring; vLLM's names and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def as_flag_value(self) -> str:
        """The flag's value that gives this config (``pagedserve serve`` forwards it)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def parse(cls, text: str | None) -> KVEventsConfig | None:
        """``--kv-events-config``'s value -> a config, or None for none (None or "").

        Raises:
            ValueError: not a JSON object, an unknown field, or a field of the wrong type or
                out of range (the message names the flag, the field and the limit).
        """
        if text is None or not text.strip():
            return None
        raw = json_flag_object(text, FLAG, _FIELDS,
                               '{"enable_kv_cache_events": true, "publisher": "zmq"}')

        def field(name: str, kind: type, lo: int | None = None) -> Any:
            value: Any = raw.get(name, field_default(cls, name))
            low = lo is not None and isinstance(value, int) and value < lo
            if (kind is bool) != isinstance(value, bool) or not isinstance(value, kind) or low:
                want = ("true or false" if kind is bool else "a string" if kind is str
                        else f"an integer >= {lo}")
                raise ValueError(f"{FLAG}: {name} must be {want}, got {value!r}")
            return value

        enabled = field("enable_kv_cache_events", bool)
        publisher = raw.get("publisher") or ("zmq" if enabled else "null")
        if publisher not in PUBLISHERS:
            raise ValueError(f"{FLAG}: publisher must be one of {list(PUBLISHERS)}, got "
                             f"{publisher!r}")
        replay = raw.get("replay_endpoint")
        if replay is not None and (not isinstance(replay, str) or not replay):
            raise ValueError(f"{FLAG}: replay_endpoint must be a ZMQ address or null, got "
                             f"{replay!r}")
        endpoint = field("endpoint", str)
        if not endpoint:
            raise ValueError(f"{FLAG}: endpoint must be a ZMQ address, got ''")
        return cls(enabled, publisher, endpoint, replay, field("buffer_steps", int, 1),
                   field("hwm", int, 0), field("max_queue_size", int, 1), field("topic", str))


def kv_events_config_arg(text: str) -> KVEventsConfig | None:
    """argparse ``type=`` for ``--kv-events-config`` (``PAGEDSERVE_KV_EVENTS_CONFIG``):
    ``KVEventsConfig.parse``, its ValueError as argparse's error (naming the field)."""
    try:
        return KVEventsConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"{FLAG}: ")) from None
