"""The request path: the stages in order (guard, cache, schedule, admission, route) and the exchange."""
from sidecar.pipeline.exchange import Exchange, Pipeline

__all__ = ["Exchange", "Pipeline"]
