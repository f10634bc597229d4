"""The request path: the stages in order (guard, cache, admission, schedule, route) and the exchange."""
from sidecar.pipeline.exchange import Exchange, Pipeline

__all__ = ["Exchange", "Pipeline"]
