"""``python -m services.cli``: the ``pagedserve`` command (services/cli/__init__.py)."""

from services.cli import main

main()
