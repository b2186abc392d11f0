"""Usage accounting: one row per finished public request in SQLite or PostgreSQL
(``database``), written in batches off the request path (``sink``), summed per key and day by
``GET /v1/usage`` (``routes``). See docs/usage.md."""
