"""Serving benchmark tool."""

