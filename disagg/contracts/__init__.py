"""The contracts every side of a cluster shares: the words of the cluster protocol
(``roles``), a context worker's answer to the generation side (``params``), the OpenAI wire
format and its checks (``protocol``, ``tools``, ``responses``, ``chat_prompt``), the worker
option schema (``options``: ``WorkerOptions``), the cluster YAML (``cluster``,
``planner_config``) and the plan launch and deploy make of it (``plan``).

Imported by the workers (``server``), the router, the launcher, deploy and bench alike; it
imports neither torch nor fastapi, nor any of its users (``tests/test_import_cycles.py``).
"""
