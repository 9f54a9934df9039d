"""disagg: disaggregated prefill/decode LLM serving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagg import torch_import

# Before anything imports torch: a CPU-only torch then skips CUDA's Python packages where UCX's
# CUDA build installed them (import torch 230 -> 218 MiB RSS; torch_import.py).
torch_import.install()

from disagg.request import SamplingParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from disagg.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy so that torch-free parts (router, bench) import without loading torch.
    if name == "LLM":
        from disagg.llm import LLM

        return LLM
    raise AttributeError(name)
