"""``disagg deploy k8s|slurm``: a many-machine cluster rendered from the disagg YAML that
``disagg launch`` starts on one machine.

``plan`` validates the YAML (the router's own loader) and decides what runs where: one router,
one worker group per server section (``num_instances`` replicas of ``tensor_parallel_size *
pipeline_parallel_size`` ranks each), every worker joining the router with ``--router-url``.
``k8s`` turns a plan into Kubernetes manifests, ``slurm`` into an sbatch script; ``grafana``
builds the Grafana dashboard of a cluster (``deploy/grafana/``, and ``k8s --monitoring``).
"""
