"""Structured outputs: what a request asks its output to match (``spec``), the grammars
compiled for it and cached per tokenizer (``grammar``), and the per-step token mask of a batch
(``mask``). The grammar engine is ``llguidance`` (imported only when a request uses it)."""
