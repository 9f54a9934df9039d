"""Tensor- and pipeline-parallel workers: one engine driving ``tp * pp`` rank processes.

- ``worker``: what every rank runs each step (``StageWorker``), the data-plane
  communicator (``RankComm``) and the spawned ranks' main (``rank_main``).
- ``messages``: the control messages between rank 0 and the other ranks (frozen dataclasses).
- ``executor``: ``DistributedExecutor``, rank 0's side: spawns and watches the other ranks,
  sends them each step's schedule and returns the logits (the ``ModelRunner`` interface).

Which layers and kv heads each rank holds: ``disagg.layout.ParallelLayout`` (torch-free).
"""
