"""External OpenAI clients against the cluster: ``python -m bench.clients`` runs the harness
(``harness.py``); each ``<lib>_client`` module is one client library's script, run by the
harness inside that library's own virtualenv as ``python -m bench.clients.<lib>_client``
(``PYTHONPATH`` set to the repository root). This file imports nothing: those virtualenvs have
only the client library, not disagg."""
