"""API keys with ids, limits and roles from a file (router ``--api-keys-file``, env
``PAGEDSERVE_API_KEYS_FILE``), reloaded on SIGHUP; ``docs/tenants.md`` has the format.

The file is YAML (or JSON, which YAML reads too): a list of entries, or a mapping whose
``keys`` is that list. Each entry::

    - id: team-a                 # shown in metrics and usage, never the key
      key_sha256: 9f86d0...      # hex SHA-256 of the key (or `key: sk-...`, the key itself)
      requests_per_minute: 20    # optional limits (services.router.quotas)
      tokens_per_minute: 50000
      max_concurrent_requests: 4
      max_priority: 2            # lowest (most urgent) priority its requests may run with
      admin: false               # may read GET /v1/usage

``KeyRing`` holds the file's keys and those of ``--api-key`` (id "default", no limits) and
identifies a request's key; it owns the router's ``Quotas``. A presented key is hashed once and
its digest compared with every file key's by ``hmac.compare_digest`` without stopping at a
match, so the time taken does not tell which key matched.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from services.common.config import add_flag
from services.router.auth import INVALID, MISSING, ApiKeys, bearer_token
from services.router.callers import Caller
from services.router.quotas import Limits, Quotas

log = logging.getLogger(__name__)
DEFAULT_KEY_ID = "default"  # the id of every --api-key key
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")
_FIELDS = frozenset({"id", "key", "key_sha256", *_LIMITS, "max_priority", "admin"})
INT32 = 2**31 - 1


class KeysFileError(ValueError):
    """The keys file cannot be read or an entry is wrong (the message names the file, the
    entry and the field; never a key)."""


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One entry of the keys file.

    Attributes:
        id: the key's id.
        digest: SHA-256 of the key (32 bytes).
        limits: its limits.
        admin: may read every key's usage.
    """

    id: str
    digest: bytes
    limits: Limits
    admin: bool = False


def _entry(item, where: str, path: str) -> KeySpec:
    """One entry, checked.

    Raises:
        KeysFileError: naming ``where`` (``keys[i]``, with the id when known) and the field.
    """
    def bad(field: str, why: str) -> KeysFileError:
        return KeysFileError(f"{path}: {where}: {field}: {why}")

    if not isinstance(item, dict):
        raise KeysFileError(f"{path}: {where}: must be a mapping of fields, got "
                            f"{type(item).__name__}")
    key_id = item.get("id")
    if not isinstance(key_id, str) or not _ID.fullmatch(key_id):
        raise bad("id", "required: 1 to 64 characters of letters, digits and ._:@- "
                        "(starting with a letter or digit)")
    where = f"{where} (id {key_id!r})"
    unknown = sorted(set(map(str, item)) - _FIELDS)
    if unknown:
        raise bad(unknown[0], f"unknown field (fields: {', '.join(sorted(_FIELDS))})")
    if ("key" in item) == ("key_sha256" in item):
        raise bad("key", "give exactly one of key and key_sha256")
    if "key" in item:
        if not isinstance(item["key"], str) or not item["key"].strip():
            raise bad("key", "must be a non-empty string")
        digest = hashlib.sha256(item["key"].strip().encode()).digest()
    else:
        if not isinstance(item["key_sha256"], str) or not _HEX.fullmatch(item["key_sha256"]):
            raise bad("key_sha256", "must be 64 hex digits (sha256sum of the key)")
        digest = bytes.fromhex(item["key_sha256"])
    values: dict[str, int] = {}
    for name in _LIMITS:
        v = item.get(name)
        if v is not None and (type(v) is not int or not 1 <= v <= INT32):
            raise bad(name, f"must be an integer in [1, {INT32}], got {v!r}")
        if v is not None:
            values[name] = v
    prio = item.get("max_priority")
    if prio is not None and (type(prio) is not int or not -INT32 - 1 <= prio <= INT32):
        raise bad("max_priority", f"must be an int32 (lower runs sooner), got {prio!r}")
    admin = item.get("admin", False)
    if not isinstance(admin, bool):
        raise bad("admin", f"must be true or false, got {admin!r}")
    return KeySpec(key_id, digest, Limits(**values, max_priority=prio), admin)


def parse_keys(text: str, path: str = "<keys file>") -> list[KeySpec]:
    """The entries of a keys file's text (YAML or JSON).

    Raises:
        KeysFileError: not YAML/JSON, not a list of entries, a bad entry, a repeated id or key.
    """
    try:
        data = json.loads(text) if text.lstrip().startswith(("[", "{")) else _yaml(text)
    except ValueError as e:  # (yaml.YAMLError is turned into ValueError by _yaml)
        raise KeysFileError(f"{path}: not valid YAML or JSON: {e}") from None
    if isinstance(data, dict) and set(data) == {"keys"}:
        data = data["keys"]
    if not isinstance(data, list):
        raise KeysFileError(f"{path}: must be a list of keys (or a mapping with one field, "
                            "keys: the list)")
    specs: list[KeySpec] = []
    ids: set[str] = set()
    digests: set[bytes] = set()
    for i, item in enumerate(data):
        spec = _entry(item, f"keys[{i}]", path)
        if spec.id in ids:
            raise KeysFileError(f"{path}: keys[{i}] (id {spec.id!r}): id: repeated")
        if spec.digest in digests:
            raise KeysFileError(f"{path}: keys[{i}] (id {spec.id!r}): key: the same key as an "
                                "earlier entry")
        ids.add(spec.id)
        digests.add(spec.digest)
        specs.append(spec)
    return specs


def _yaml(text: str):
    import yaml  # type: ignore[import-untyped]  # PyYAML (pinned in requirements.lock)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(str(e)) from None


def load_keys_file(path: str) -> list[KeySpec]:
    """The entries of the keys file at ``path``.

    Raises:
        KeysFileError: unreadable, or as ``parse_keys``.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeysFileError(f"{path}: cannot read the keys file: {e}") from None
    return parse_keys(text, path)


class KeyRing:
    """The keys a router accepts: ``--api-key``'s (id "default", no limits, not admin) and
    ``--api-keys-file``'s, with the router's ``Quotas`` (one for HTTP and gRPC).

    Its ``str``/``repr`` never show a key.

    Args:
        api_keys: ``--api-key``'s keys, or None.
        path: ``--api-keys-file``, or None.
        quotas: the limit state (a new one by default).

    Raises:
        KeysFileError: the file is unreadable or wrong.
    """

    def __init__(self, api_keys: ApiKeys | None, path: str | None,
                 quotas: Quotas | None = None):
        self.api_keys = api_keys
        self.path = path
        self.quotas = quotas or Quotas()
        self._specs: tuple[KeySpec, ...] = ()
        if path is not None:
            self._set(load_keys_file(path))
        else:
            self.quotas.configure({})

    def __repr__(self) -> str:
        return (f"<KeyRing: {len(self._specs)} keys from {self.path}, "
                f"{len(self.api_keys) if self.api_keys else 0} --api-key keys, redacted>")

    __str__ = __repr__

    def __len__(self) -> int:
        return len(self._specs) + (len(self.api_keys) if self.api_keys else 0)

    def __bool__(self) -> bool:
        return True  # NOTE: a ring without keys (an empty file) refuses every request

    @property
    def ids(self) -> list[str]:
        """The file's key ids, in file order."""
        return [s.id for s in self._specs]

    def _set(self, specs: list[KeySpec]) -> None:
        self.quotas.configure({s.id: s.limits for s in specs})
        self._specs = tuple(specs)

    def reload(self) -> bool:
        """Read the keys file again; on an error keep the keys in use and log why. Limit state
        of the keys that stay is kept (``Quotas.configure``). Returns whether it was loaded."""
        if self.path is None:
            return False
        try:
            specs = load_keys_file(self.path)
        except KeysFileError as e:
            log.error("API keys file not reloaded, the %d keys in use are kept: %s",
                      len(self._specs), e)
            return False
        self._set(specs)
        log.info("API keys file reloaded: %d keys", len(specs))
        return True

    def identify(self, authorization: str | bytes | None) -> Caller | str:
        """The caller whose key the ``Authorization`` value carries, else why not (a message
        that never contains the key)."""
        token = bearer_token(authorization)
        if token is None:
            return MISSING
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for spec in self._specs:  # NOTE: no early exit: every key is compared
            if hmac.compare_digest(digest, spec.digest):
                found = spec
        default = self.api_keys is not None and self.api_keys.matches(token)
        if found is not None:
            return Caller(found.id, found.admin)
        return Caller(DEFAULT_KEY_ID) if default else INVALID


def key_ring(args) -> KeyRing | None:
    """The router's keys from ``--api-key`` and ``--api-keys-file``; None when neither is set
    (every request is let in, as "anonymous").

    Raises:
        KeysFileError: the file is unreadable or wrong.
    """
    if args.api_key is None and args.api_keys_file is None:
        return None
    return KeyRing(args.api_key, args.api_keys_file)


def reload_on_sighup(ring: KeyRing) -> bool:
    """Reload ``ring``'s file on SIGHUP (a handler on the running loop). Returns False where
    the loop cannot take signals (not the main thread: tests), or there is no file."""
    if ring.path is None:
        return False
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, ring.reload)
    except (NotImplementedError, RuntimeError, ValueError):
        return False
    return True


def stop_reloading() -> None:
    """Remove the SIGHUP handler of ``reload_on_sighup`` (if any) from the running loop."""
    try:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
    except (NotImplementedError, RuntimeError, ValueError):
        pass


def add_api_keys_file_flag(p: argparse.ArgumentParser) -> None:
    """``--api-keys-file`` (env ``PAGEDSERVE_API_KEYS_FILE``)."""
    add_flag(p, "--api-keys-file", default=None, metavar="PATH",
             help="YAML or JSON list of API keys, each with an id, the key or its key_sha256, "
                  "and optional requests_per_minute, tokens_per_minute, "
                  "max_concurrent_requests, max_priority and admin (docs/tenants.md); "
                  "reloaded on SIGHUP; works beside --api-key")
