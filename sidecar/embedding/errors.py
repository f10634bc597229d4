"""What can go wrong in the embedding engine, split by what the caller should do about it.

- `EmbeddingUnavailable` and its subclasses: this one request goes on without semantic
  features (no semantic cache look-up or store); nothing is wrong with the sidecar.
- `ModelLoadError`: the sidecar must not start (or must stay NOT_SERVING).
"""
from __future__ import annotations


class EmbeddingUnavailable(Exception):
    """No vector for this request; skip semantic features for it."""


class NothingToEmbed(EmbeddingUnavailable, ValueError):
    """The text is empty once normalised, or has no token the model knows."""


class QueueFull(EmbeddingUnavailable):
    """The engine is saturated; rejected at once rather than queued behind others."""


class NotReady(EmbeddingUnavailable):
    """The model is not loaded and warmed yet, or the engine is shutting down."""


class ModelLoadError(RuntimeError):
    """The model or tokenizer files are missing, corrupt, of the wrong shape or checksum."""
