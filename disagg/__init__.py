"""disagg: disaggregated prefill/decode LLM serving."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagg.request import SamplingParams

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
