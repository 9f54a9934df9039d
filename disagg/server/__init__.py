"""OpenAI-compatible worker server."""

