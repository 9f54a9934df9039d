"""``python -m bench.clients``: the harness (``bench/clients/harness.py``)."""

from bench.clients.harness import cli

cli()
