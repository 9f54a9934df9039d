"""The router in front of a disaggregated (or aggregated) cluster: ``disagg router -c FILE``.

Modules: ``config`` (the cluster YAML, torch-free), ``policies`` (round robin, load balancing,
KV-cache aware), ``kv_index`` (per-worker index of cached block hashes fed by worker KV events),
``membership`` (workers: static and registered, health, load), ``metrics`` (Prometheus),
``app`` (the aiohttp server: request flow, retries; ``build_router_app``), ``cli``.
"""
