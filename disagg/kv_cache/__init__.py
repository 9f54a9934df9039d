"""Paged KV cache: block pool, hashing and the per-request manager (torch-free)."""

