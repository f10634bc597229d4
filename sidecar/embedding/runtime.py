"""The onnxruntime session: which execution provider, how many threads, is the graph usable.

Everything here runs once at load; errors become ModelLoadError so the start fails with
a message that says what to fix.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort

from sidecar.embedding.errors import ModelLoadError

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
REQUIRED_INPUTS = ("input_ids", "attention_mask")
KNOWN_INPUTS = REQUIRED_INPUTS + ("token_type_ids",)


def choose_providers(provider: str, available: Sequence[str]) -> list[str]:
    """onnxruntime providers, best first, for the `provider` setting (auto|cpu|cuda)."""
    if provider == "cpu":
        return [CPU]
    if CUDA in available:
        return [CUDA, CPU]
    if provider == "cuda":
        raise ModelLoadError(
            "provider=cuda, but this onnxruntime has no CUDA provider: install onnxruntime-gpu "
            "(pip install 'sluice[gpu]') or set SLUICE_EMBED_PROVIDER=cpu")
    return [CPU]


def open_session(model: Path, provider: str, intra_op_threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Idle pool threads would otherwise spin between runs and take the CPU from the event
    # loop and Envoy, which share this box.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = choose_providers(provider, ort.get_available_providers())
    if CUDA in providers and hasattr(ort, "preload_dlls"):
        # onnxruntime-gpu finds CUDA and cuDNN installed as nvidia-* pip packages only
        # when asked to; where they are system libraries this changes nothing.
        try:
            ort.preload_dlls(msvc=False)
        except Exception:  # best effort: session creation reports what is really missing
            pass
    try:
        session = ort.InferenceSession(str(model), sess_options=options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own classes for bad protobuf, bad graph
        raise ModelLoadError(f"cannot load embedding model {model}: {exc}") from exc
    if provider == "cuda" and session.get_providers()[0] != CUDA:
        raise ModelLoadError("provider=cuda, but onnxruntime found no usable GPU "
                             "(driver, CUDA or cuDNN libraries); set SLUICE_EMBED_PROVIDER=cpu")
    check_signature(session, model)
    return session


def check_signature(session: ort.InferenceSession, model: Path) -> None:
    """The graph must take the inputs Sluice feeds and give [batch, seq, dim] hidden states."""
    names = [i.name for i in session.get_inputs()]
    missing = [n for n in REQUIRED_INPUTS if n not in names]
    unknown = [n for n in names if n not in KNOWN_INPUTS]
    if missing or unknown:
        raise ModelLoadError(
            f"embedding model {model} has inputs {names}; expected {list(REQUIRED_INPUTS)} "
            "and optionally token_type_ids")
    output = session.get_outputs()[0]
    if len(output.shape) != 3:
        raise ModelLoadError(
            f"embedding model {model} gives {output.name} of shape {output.shape}; "
            "expected [batch, sequence, dim] hidden states")
