"""The router in front of a disaggregated (or aggregated) cluster: ``disagg router -c FILE``.

Modules: ``config`` (the cluster YAML, torch-free), ``policies`` (round robin, load balancing,
KV-cache aware), ``kv_index`` (per-worker index of cached block hashes fed by worker KV events),
``membership`` (workers: static and registered, health, load), ``metrics`` (Prometheus),
``prompt_tokens`` (the prompt's token ids for the policies), ``upstream`` (the client of the
workers), ``relay`` (their answers passed to the client), ``client_io`` (the answer, whichever
server carries it), ``front`` (the router's own HTTP/1.1 server for the common OpenAI request;
aiohttp serves the rest), ``flow`` (one call or two, with one
retry helper), ``handlers`` (the HTTP endpoints), ``replies`` (the router's own answers),
``router`` (the parts assembled, started, stopped), ``app`` (``build_router_app``,
``start_router``), ``cli``.
"""
