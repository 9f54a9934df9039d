"""Llama-family model, loader and tiny checkpoints."""

