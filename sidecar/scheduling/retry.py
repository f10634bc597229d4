"""Where a request that fails before its first byte is retried: the next-best healthy candidate.

Envoy does the retry (one, before any answer byte): the route's cluster header names a composite
cluster that sends the first attempt to the chosen cluster and the retry to the other one
(`retry_cluster_name`). The other one is the scheduler's runner-up: the best-scored other
candidate of the chosen tier, else one of the next tier, whose breaker is closed and that takes
the very same request body (a retry resends it unchanged). Pure: health comes in as a callable.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from sidecar.scheduling.model import CandidateSpec
from sidecar.scheduling.scheduler import Decision

# Envoy cluster names allow any characters, but '.' and ':' are stat-name separators.
RETRY_SEPARATOR = "__then__"


def retry_cluster_name(first: str, then: str) -> str:
    return f"{first}{RETRY_SEPARATOR}{then}"


def retry_clusters(candidates: Sequence[CandidateSpec]) -> list[str]:
    """The composite clusters Envoy needs for a route's candidates: each ordered pair."""
    names = [c.cluster for c in candidates]
    return [retry_cluster_name(a, b) for a in names for b in names if a != b]


def retry_candidate(decision: Decision, candidates: Sequence[CandidateSpec],
                    healthy: Callable[[CandidateSpec], bool],
                    same_body: Callable[[CandidateSpec], bool]) -> CandidateSpec | None:
    """The candidate to retry on, or None (no other healthy one takes the same body)."""
    if decision.cluster is None:
        return None
    scores = decision.scores

    def rank(spec: CandidateSpec) -> tuple:
        scored = spec.cluster in scores
        # The chosen tier by score first, then the rest of the candidates in the route's order.
        return (not scored, spec.role != decision.role, -scores[spec.cluster].total if scored else 0.0)
    others = [c for c in candidates if c.cluster != decision.cluster and c.weight > 0
              and c.cluster not in decision.dropped]
    for spec in sorted(others, key=rank):
        if healthy(spec) and same_body(spec):
            return spec
    return None
