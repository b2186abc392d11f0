"""Who sent a public request: the API key's id, set once at the edge (the HTTP middleware or
the gRPC interceptor that checked the key) and read wherever the request is counted (quotas,
usage accounting, metrics), the same for HTTP and gRPC."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Caller:
    """The key a request came with.

    Attributes:
        key_id: the key's id from ``--api-keys-file`` (never the key itself); "default" for
            a key of ``--api-key``; "anonymous" when the router checks no keys.
        admin: the key may read every key's usage (``GET /v1/usage``).
    """

    key_id: str
    admin: bool = False


ANONYMOUS = Caller("anonymous")
# The caller of the request the current task serves (set by the edge that checked its key).
caller_var: contextvars.ContextVar[Caller] = contextvars.ContextVar("caller", default=ANONYMOUS)
