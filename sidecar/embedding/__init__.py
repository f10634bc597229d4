"""Embedding engine: prompts to unit vectors for the semantic cache (all-MiniLM-L6-v2, ONNX).

Public API; the modules each do one step:
normalize (text clean-up), prompt (what of a chat request is embedded), tokens
(tokenize, keep the end), planning (group by length), tensors (pad, pool), runtime
(onnxruntime session), model_files (paths, sha256), loader (load + warm), encoder
(blocking texts -> vectors), batcher (asyncio micro-batching), service (all of it).

Importing this package stays light (no onnxruntime) so the cache can use normalize_text
and split_prompt cheaply; the service loads on first use of its names.
"""
from sidecar.embedding.errors import (EmbeddingUnavailable, ModelLoadError, NothingToEmbed,
                                      NotReady, QueueFull)
from sidecar.embedding.normalize import normalize_text
from sidecar.embedding.prompt import PromptParts, split_prompt
from sidecar.embedding.settings import EmbeddingSettings

__all__ = [
    "EmbeddedPrompt", "EmbeddingService", "EmbeddingSettings", "EmbeddingUnavailable",
    "ModelLoadError", "NotReady", "NothingToEmbed", "PromptParts", "QueueFull",
    "normalize_text", "split_prompt",
]


def __getattr__(name: str):
    if name in ("EmbeddingService", "EmbeddedPrompt"):
        from sidecar.embedding import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
