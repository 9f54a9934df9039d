"""Device checks and the GPU benchmark (``python -m bench.gpu.<name>``; ``bench/gpu/run_all.sh``
runs them all on the GPU machine)."""
