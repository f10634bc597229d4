"""Metrics, logs, spans and the request log."""
