"""The project's benchmarks and device checks, one module each, run from the repository root
as ``python -m bench.<name>`` (``python -m bench.gpu.<name>`` for the GPU ones); what each
measures and which of disagg's modules it reads is listed in ``bench/README.md``.

This package imports nothing: ``bench.clients.*`` run inside other virtualenvs (the client
libraries', without disagg), and importing one of them imports this file first.
"""
