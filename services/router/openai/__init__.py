"""The router's OpenAI-compatible HTTP API (aiohttp routes, JSON <-> api.proto), one module
per concern; the module map is in docs/architecture.md and the field mapping in docs/openai.md.

Importing the package imports none of its modules (``http`` is the entry point, used by
``services.router.server``). The name does not shadow the ``openai`` client package: imports
are absolute, and nothing puts ``services/router`` on ``sys.path``.
"""
